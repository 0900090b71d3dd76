"""Experiments CLI for nonans_optim: ``python -m experiments <command>``.

Each command lives in its own module exposing ``main(argv: list[str]) -> int``; the registry in
``experiments/__main__.py`` maps command names to modules. Results land as JSON under ``results/`` and are
rendered into RESULTS.md / OPEN_QUESTIONS.md by ``python -m experiments render``.
"""
