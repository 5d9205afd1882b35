"""mkdocs hook: the API reference of docs/api.md, generated from the docstrings.

Where docs/api.md holds the marker ``<!-- api-reference -->``, this writes one mkdocstrings
directive (``::: module.Name``) per public name, read from the package's own table of public
names (``_PUBLIC`` in python/mps_fused_adam/__init__.py, parsed, not imported), followed by the
few public functions outside it. The signatures and docstrings then come from the code, so the
page cannot drift from it; a name added to the package appears on the page with nothing else to
edit."""
from __future__ import annotations

import ast
from pathlib import Path

MARKER = "<!-- api-reference -->"
ROOT = Path(__file__).resolve().parents[1]
INIT = ROOT / "python" / "mps_fused_adam" / "__init__.py"
# Public functions of submodules that the package does not re-export at its top level.
EXTRA = [("DeepSpeed", ["mps_fused_adam.deepspeed.install", "mps_fused_adam.deepspeed.kernel_calls"]),
         ("step_in_backward", ["mps_fused_adam.optimizers.consumed_grads.grad_norm",
                               "mps_fused_adam.optimizers.in_backward.remove_hooks"]),
         ("Checkpoints from other libraries", ["mps_fused_adam.bnb_compat", "mps_fused_adam.torchao_compat"])]


def public_names(init: Path = INIT) -> dict[str, str]:
    """``_PUBLIC``: public name -> the submodule (relative to the package) that defines it."""
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_PUBLIC" for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"no _PUBLIC table in {init}")


def reference_markdown(names: dict[str, str] | None = None) -> str:
    names = public_names() if names is None else names
    classes = sorted(n for n in names if n[0].isupper())
    functions = sorted(n for n in names if not n[0].isupper())
    lines = ["### Optimizers", ""]
    lines += [f"::: mps_fused_adam.{names[n]}.{n}\n" for n in classes]
    lines += ["### Functions", ""]
    lines += [f"::: mps_fused_adam.{names[n]}.{n}\n" for n in functions]
    for title, paths in EXTRA:
        lines += [f"### {title}", ""] + [f"::: {p}\n" for p in paths]
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, **_) -> str:
    if page.file.src_uri == "api.md":
        if MARKER not in markdown:
            raise ValueError(f"docs/api.md has lost its {MARKER} marker")
        return markdown.replace(MARKER, reference_markdown())
    return markdown
