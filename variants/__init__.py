"""The forks of scgrpo.py, each a program (README.md here), and each one's tests beside it."""
