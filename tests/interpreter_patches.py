"""Make Triton's CPU interpreter patch ``triton.language`` once per launch instead of once per helper call.

Why: under ``TRITON_INTERPRET=1`` every launch (``interpreter.GridExecutor.__call__``) replaces the
builtins of ``triton.language`` with their interpreted versions and restores them afterwards — and so does
every *call of a* ``@triton.jit`` *helper* inside the kernel (``InterpretedFunction.__call__`` calls
``_patch_lang`` again, walking ``tl``, ``tl.tensor`` and ``tl.math`` with ``inspect.getmembers``). Our
kernels are built from small helpers (a block, a row, a gate: ``kernels/scalar_update.py``,
``kernels/spectral_blocks.py``), called per block and per loop iteration, so a profile of one spectral case
(``case_clean_repair_is_off``, triton 3.9) spent about half its time in those repeated patches: 22,158
helper calls for 45 launches. Each suite under ``TRITON_INTERPRET=1`` in a fresh pytest process, stock
Triton against this module (2026-11-27, 2-core Xeon, the two series side by side on the two cores, so the
later stock suites ran alone, which favours stock): spectral step 409 s → 199 s, scalar step 127 → 76 s,
record 45 → 22 s, NS5 pieces (interpret) 106 → 76 s, elementwise 5.8 → 3.6 s. The whole CI run
(``pytest -n 2``) went from 14 min 12 s to 10 min 17 s.

Why it is safe: within one launch, a helper's re-patch installs the same replacements over the ones the
launch (or an earlier helper of the same modules) already installed — the builtins are already replaced,
so ``_patch_builtin`` skips them, and the tensor and core patches are equal closures — and its scope is
discarded, never restored, in stock Triton too. So a helper call is skipped only when every language
module its globals hold was already patched in this launch; anything new (``triton.language.core`` seen
first by one of ``tl.standard``'s helpers, say) is patched exactly as stock Triton patches it. Nothing
changes outside a launch. ``tests/test_kernels_interpret.py::test_language_patches_are_shared_per_launch``
checks the outputs equal stock patching's and that a launch patches once.

Test infrastructure only (installed by ``tests/conftest.py`` in interpreter subprocesses): the library never
patches Triton.
"""
from __future__ import annotations

import inspect

_stock = None  # interpreter._patch_lang as Triton defines it (tests wrap it to count the real patches)
_patched: set[int] | None = None  # ids of the language modules patched in the launch running now
_LANGUAGES: tuple = ()  # (triton.language, triton.language.core), set on install
_EMPTY_SCOPE = None  # interpreter._LangPatchScope, set on install


def _languages(fn) -> set[int]:
    """The language modules ``_patch_lang`` patches for ``fn``: those among its globals (its own rule)."""
    return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in _LANGUAGES}


def _shared(fn):
    """``_patch_lang`` as installed: called at every launch and every helper call (the imports it needs are
    resolved once, at install)."""
    global _patched
    langs = _languages(fn)
    if _patched is not None and langs and langs <= _patched:
        return _EMPTY_SCOPE()  # already in place for this launch: nothing to restore either
    scope = _stock(fn)
    if _patched is not None:
        _patched |= langs
    return scope


def share_language_patches() -> bool:
    """Install the sharing (idempotent); False, leaving Triton as it is, where its interpreter does not
    have the pieces this relies on (then the suites run at stock speed, and the test says so)."""
    global _stock, _LANGUAGES, _EMPTY_SCOPE
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    grid = getattr(interpreter, "GridExecutor", None)
    if not all(hasattr(interpreter, n) for n in ("_patch_lang", "_LangPatchScope")) or grid is None:
        return False
    if getattr(grid.__call__, "_shares_patches", False):
        return True
    launch = grid.__call__

    def call(self, *args, **kwargs):
        global _patched
        outer, _patched = _patched, set()  # a launch starts with nothing patched by it
        try:
            return launch(self, *args, **kwargs)
        finally:
            _patched = outer

    call._shares_patches = True
    call._stock = launch
    _stock = interpreter._patch_lang
    _LANGUAGES, _EMPTY_SCOPE = (tl, tl.core), interpreter._LangPatchScope
    interpreter._patch_lang = _shared
    grid.__call__ = call
    return True


def installed() -> bool:
    """Whether :func:`share_language_patches` is in effect in this process."""
    from triton.runtime import interpreter
    grid = getattr(interpreter, "GridExecutor", None)
    return (getattr(getattr(grid, "__call__", None), "_shares_patches", False)
            and getattr(interpreter, "_patch_lang", None) is _shared)


def programs_in_order(monkeypatch, order: str, seed: int = 0) -> None:
    """Make the interpreter run each launch's programs in ``order`` — "ascending" (its own), "reversed" or
    "shuffled" (seeded) — instead of by ascending program id, for the rest of the test.

    Why: a kernel whose programs hand work to one another (the one-launch AdamW step's last program,
    ``kernels/scalar_one.py``; the folded decisions, ``kernels/decisions.py``, where each tensor's last
    ticket decides) must be right whichever program finishes last, as on a GPU. In ascending order the
    highest program id is always last, so a kernel that picked its decider by id instead of by ticket
    would pass here and fail there. Any order in which programs run one at a time is a schedule a GPU may
    run, so each is a fair test. How: the launch loops over the grid with ``range``, looked up in the
    interpreter module's globals first; a ``range`` there permutes the single-argument ranges that the
    launch itself (the stock ``GridExecutor.__call__``, checked by its frame) iterates, and nothing else."""
    import builtins
    import random
    import sys

    from triton.runtime import interpreter

    if order not in ("ascending", "reversed", "shuffled"):
        raise ValueError(f"order must be 'ascending', 'reversed' or 'shuffled', got {order!r}")
    if order == "ascending":
        return
    call = interpreter.GridExecutor.__call__
    launch = getattr(call, "_stock", call).__code__  # (under share_language_patches, the stock one)
    rng = random.Random(seed)

    def grid_range(*args):
        if len(args) == 1 and sys._getframe(1).f_code is launch:
            ids = list(builtins.range(args[0]))
            if order == "reversed":
                return ids[::-1]
            rng.shuffle(ids)
            return ids
        return builtins.range(*args)

    monkeypatch.setattr(interpreter, "range", grid_range, raising=False)
