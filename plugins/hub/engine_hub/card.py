"""The model card (README.md) pushed with the final model: how the run was composed and how it ended."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine import __version__, to_toml


def write_model_card(run: Any, path: Path, options: Any, metrics: dict[str, Any]) -> None:
    """``metrics``: the last value of every metric the run logged."""
    from engine.kit.checkpoint import versions  # here: the upload process imports this package, without torch

    model = run.config.train.model
    plugins = versions(run)["plugins"]
    rows = "\n".join(f"| {key} | {value} |" for key, value in metrics.items())
    plugin_lines = "\n".join(f"- `{name}`: {origin}" for name, origin in plugins.items()) or "- (none)"
    text = f"""---
library_name: transformers
tags:
- engine
---

# {Path(options.repo.rstrip('/')).name}

Trained with engine {__version__} from `{model}` for {run.state.global_step} steps
(run `{run.run_id}`, {run.state.epoch:.4g} epochs).

## Plugins

{plugin_lines}

## Final metrics

| metric | value |
|---|---|
{rows}

## Configuration

```toml
{to_toml(run.config.to_mapping()).rstrip()}
```
"""
    path.write_text(text, encoding="utf-8")
