"""
The token-credit page: which tokens of an answer SC-GRPO weighted (the paper's Figure 10),
each shaded by its weight f(D), with D on hover and the reference the teacher saw beside it.
"""
import html


def credit_examples(tok, ro, batch):
    """The first answer a teacher scored in each of up to 4 groups, for the credit page."""
    first = {}
    for m in batch.scored.tolist():
        if len(first) < 4:
            first.setdefault(int(batch.question[m]), m)
    out = []
    for b, m in first.items():
        n, j = int(batch.row[m]), int(batch.ref[m])
        L = int(ro.mask[n].sum())
        out.append(dict(question=ro.problems[b]["question"], route=batch.route[m],
                        adv=float(batch.adv[m]), reward=float(ro.correct.view(-1)[n]),
                        weights=batch.weights[m, :L].tolist(), kl=batch.kl[m, :L].tolist(),
                        tokens=[tok.decode([t]) for t in ro.ids[n, :L].tolist()],
                        reference=ro.texts[j]))
    return out


def write_credit_html(path, step, examples):
    """One self-contained page: each routed answer with its tokens shaded by the weight f(D),
    the token's KL D on hover, and the reference the teacher saw beside it."""
    shade = "rgba(230,90,20,{:.3f})"
    cards = []
    for ex in examples:
        spans = "".join(f'<span style="background:{shade.format(w)}" title="D = {d:.4g}, '
                        f'f(D) = {w:.3f}">{html.escape(t)}</span>'
                        for t, w, d in zip(ex["tokens"], ex["weights"], ex["kl"]))
        cards.append(
            f'<div class="card"><p><b>Q:</b> {html.escape(ex["question"])}</p><p>route '
            f'<b>{ex["route"]}</b> | reward {ex["reward"]:.0f} | advantage {ex["adv"]:+.3f}</p>'
            f'<div class="row"><div class="col"><h4>answer, shaded by f(D)</h4><pre>{spans}'
            '</pre></div><div class="col"><h4>reference the teacher saw</h4><pre>'
            f'{html.escape(ex["reference"])}</pre></div></div></div>')
    style = ("body{font-family:sans-serif;max-width:1200px;margin:auto;padding:0 16px}"
             ".card{border:1px solid #ccc;padding:8px;margin:12px 0}.row{display:flex;gap:16px}"
             ".col{flex:1;min-width:0}pre{white-space:pre-wrap;font-size:18px;line-height:1.6}"
             "span{padding:1px 0}")
    key = ("<span style='display:inline-block;width:160px;height:14px;vertical-align:middle;"
           "background:linear-gradient(90deg,rgba(230,90,20,0),rgba(230,90,20,1))'></span>")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"<!doctype html><html><head><meta charset='utf-8'><title>SC-GRPO credit, step "
                f"{step}</title><style>{style}</style></head><body><h2>Token credit at step "
                f"{step}</h2><p>Darker = larger weight f(D) = D / (D + c); hover a token for its "
                f"KL D. &nbsp; f(D) = 0 {key} 1</p>{''.join(cards)}</body></html>")


