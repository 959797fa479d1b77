"""Write docs/hooks.md, the hook reference, from the docstrings in engine/hookspecs.py (and the modules of hook
specs that join it, such as engine/builtin/hookspecs.py).

    python docs/generate_hooks.py          # rewrite docs/hooks.md
tests/test_contract.py fails when the file is out of date.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

OUTPUT = Path(__file__).with_name("hooks.md")


def render() -> str:
    from engine import hookspecs

    lines = ["# Hook reference", "",
             "Generated from `engine/hookspecs.py` by `python docs/generate_hooks.py`; do not edit.", "",
             inspect.cleandoc(hookspecs.__doc__), ""]
    declared_in = hookspecs.__name__
    for name, function in vars(hookspecs).items():
        opts = getattr(function, "engine_spec", None)
        if opts is None:
            continue
        if function.__module__ != declared_in:  # joined through the entry-point group engine.hookspecs
            declared_in = function.__module__
            lines += [f"# Hooks declared in `{declared_in}`", "", inspect.cleandoc(sys.modules[declared_in].__doc__), ""]
        signature = str(inspect.signature(function)).replace("'", "")
        kind = hookspecs.combine_kind(name)
        # a stable anchor (hooks.md#compute_loss): the heading's own changes with the signature
        lines += [f'<a id="{name}"></a>', "", f"## `{name}{signature}`", "", f"*{kind}*", "",
                  inspect.cleandoc(function.__doc__), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}")
