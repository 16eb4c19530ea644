"""Print the policy-file reference (every field, its default, what it does) as Markdown, from the pydantic schema.

README's "Policy file" section is this script's output, so the documentation cannot drift from the code:
    python scripts/policy_reference.py > /tmp/ref.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from policies.config import KvgateConfig  # noqa: E402


def _default(field) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
        if isinstance(value, BaseModel):
            return "(section)"
    elif field.default_factory is not None:
        value = field.default_factory()
    else:
        return "required"
    return "`" + json.dumps(value) + "`"


def _section_type(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):  # list[ReplicaConfig]
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def render(model: type[BaseModel], prefix: str, out: list[str]) -> None:
    rows, nested = [], []
    for name, field in model.model_fields.items():
        sub = _section_type(field.annotation)
        path = f"{prefix}{name}"
        if sub is not None:
            nested.append((sub, path + ("[]." if "list" in str(field.annotation) else ".")))
            continue
        desc = (field.description or "").replace("\n", " ").replace("|", "\\|")
        rows.append(f"| `{path}` | {_default(field)} | {desc} |")
    if rows:
        title = prefix.rstrip(".") or "(top level)"
        doc = (model.__doc__ or "").strip().splitlines()[0] if model.__doc__ else ""
        out.append(f"#### `{title}`" + (f" — {doc}" if doc and not doc.startswith("The whole") else ""))
        out.append("")
        out.append("| field | default | meaning |")
        out.append("|---|---|---|")
        out.extend(rows)
        out.append("")
    for sub, path in nested:
        render(sub, path, out)


def main() -> None:
    out: list[str] = []
    render(KvgateConfig, "", out)
    print("\n".join(out))


if __name__ == "__main__":
    main()
