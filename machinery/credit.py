"""
The token-credit page: which tokens of an answer a method weighted (the paper's Figure 10), each
token shaded by a per-token signal, its value on hover, and the context the teacher saw beside
it. A run writes one at each evaluation from its step's answers: SC-GRPO shades by f(D) (D on
hover); a variant passes its own signal (variants/rlsd.py: RLSD's weight). tools/signals.py puts
several methods' signals for one answer on one page.
"""
import html

F_OF_D = dict(name="f(D)", lo=0.0, hi=1.0)  # SC-GRPO's weight, in [0, 1); D on hover


def credit_examples(tok, ro, batch, credit=None):
    """The first answer of each of up to 4 groups among the rows a teacher scored, for the credit
    page: its tokens shaded by batch.weights, and the teacher's prompt beside them. The credit seam
    that made the weights may name them: its attribute `signal` (a dict like F_OF_D; default f(D),
    with D on hover)."""
    signal = getattr(credit, "signal", F_OF_D)
    first = {}
    for m in batch.scored.tolist():
        if len(first) < 4:
            first.setdefault(int(batch.question[m]), m)
    out = []
    for b, m in first.items():
        n, L = int(batch.row[m]), int(ro.mask[int(batch.row[m])].sum())
        hover = dict(hover="D", hover_values=batch.kl[m, :L].tolist()) if signal is F_OF_D else {}
        out.append(dict(question=ro.problems[b]["question"], route=batch.route[m],
                        adv=float(batch.adv[m]), reward=float(ro.correct.view(-1)[n]),
                        tokens=[tok.decode([t]) for t in ro.ids[n, :L].tolist()],
                        context=tok.decode(batch.teacher_prompt[m], skip_special_tokens=True),
                        signals=[dict(signal, values=batch.weights[m, :L].tolist(), **hover)]))
    return out


def shade(value, lo, hi, center=None):
    """A token's background: orange by (value - lo) / (hi - lo); with a center, blue below it and
    orange above, by the distance to it over the range's half on that side."""
    if center is None:
        return f"rgba(230,90,20,{min(max((value - lo) / ((hi - lo) or 1.0), 0.0), 1.0):.3f})"
    # a range of width 0 (RLSD's weight once its lambda reaches 0: every weight 1) shades nothing
    side = (value - center) / (((hi - center) if value >= center else (center - lo)) or 1.0)
    rgb = "230,90,20" if value >= center else "40,110,220"
    return f"rgba({rgb},{min(abs(side), 1.0):.3f})"


def signal_row(sig, tokens):
    """One signal over an answer's tokens: its name, range and shaded spans (value on hover)."""
    hover = sig.get("hover_values") or [None] * len(tokens)
    spans = "".join(
        f'<span style="background:{shade(v, sig["lo"], sig["hi"], sig.get("center"))}" title="'
        + (f'{sig["hover"]} = {h:.4g}, ' if h is not None else "")
        + f'{html.escape(sig["name"])} = {v:.3f}">{html.escape(t)}</span>'
        for t, v, h in zip(tokens, sig["values"], hover))
    scale = f"{sig['lo']:g} .. {sig['hi']:g}"
    scale += f", centre {sig['center']:g}" if "center" in sig else ""
    return (f'<h4>{html.escape(sig["name"])} <small>(shade: {scale})</small></h4>'
            f'<pre>{spans}</pre>')


def write_credit_html(path, title, examples, note=""):
    """One self-contained page: each answer with a row of shaded tokens per signal (its value on
    hover), and the context the teacher saw beside it."""
    cards = []
    for ex in examples:
        rows = "".join(signal_row(sig, ex["tokens"]) for sig in ex["signals"])
        cards.append(
            f'<div class="card"><p><b>Q:</b> {html.escape(ex["question"])}</p><p>route '
            f'<b>{html.escape(ex["route"])}</b> | reward {ex["reward"]:.0f} | advantage '
            f'{ex["adv"]:+.3f}</p><div class="row"><div class="col">{rows}</div>'
            f'<div class="col"><h4>what the teacher saw</h4><pre>{html.escape(ex["context"])}</pre>'
            '</div></div></div>')
    style = ("body{font-family:sans-serif;max-width:1200px;margin:auto;padding:0 16px}"
             ".card{border:1px solid #ccc;padding:8px;margin:12px 0}.row{display:flex;gap:16px}"
             ".col{flex:1;min-width:0}pre{white-space:pre-wrap;font-size:18px;line-height:1.6}"
             "span{padding:1px 0}h4{margin:8px 0 2px}")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
                f"</title><style>{style}</style></head><body><h2>{html.escape(title)}</h2>"
                f"<p>Darker = a larger value; hover a token for its values. {note}</p>"
                f"{''.join(cards)}</body></html>")
