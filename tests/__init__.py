"""The tests beside the story's own (test_scgrpo.py), one file per role."""
