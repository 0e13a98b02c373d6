"""The convergence study: does a model train as well under each recipe as in bf16, on real text?

    python -m qtensor.study --out DIR [--runs all] [--jobs N] [--steps S] ...

See `docs/convergence.md` for the setup, the committed results and what they say.
"""
