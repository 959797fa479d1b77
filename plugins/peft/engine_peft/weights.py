"""What an adapter run's checkpoints and final model hold, in peft's own layout.

    checkpoint-<step>/ (and output_dir/)
        adapter_model.safetensors, adapter_config.json   what PeftModel.save_pretrained writes
        base_fingerprint.json                            the base it was trained on: name, and
                                                         xxh3-64 of its config and of its weights
    output_dir/
        base/                                            the base, when it was built from a config
        merged/                                          merge = true: the merged full model
        README.md                                        model card: base, adapter config, metrics

The engine writes the other checkpoint files (optimizer, scheduler, RNG, plugin state, manifest
with checksums) as for any model.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
import xxhash

from engine import CheckpointError, ModelWeights

logger = logging.getLogger("engine.peft")

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
FINGERPRINT = "base_fingerprint.json"
# module path components peft inserts around the base's own modules
_WRAPPER_PARTS = re.compile(r"\.(base_layer|original_module)(?=\.)")


def base_state(model: Any) -> dict[str, torch.Tensor]:
    """The base model's own state dict (its names, without the adapter) from a PeftModel."""
    prefix = model.base_model.prefix  # "lora_", "ia3_": names of the adapter's own modules
    state = {}
    for name, tensor in model.get_base_model().state_dict().items():
        parts = name.split(".")
        if any(part.startswith(prefix) or part == "modules_to_save" for part in parts):
            continue
        state[_WRAPPER_PARTS.sub("", name)] = tensor
    return state


def _digest_tensors(state: dict[str, torch.Tensor]) -> str:
    digest = xxhash.xxh3_64()
    for name in sorted(state):
        tensor = state[name].detach()
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def base_fingerprint(model: Any, base: str) -> dict[str, str]:
    """Name, config and weights checksums of a PeftModel's base (read once, when the run starts)."""
    config = model.get_base_model().config.to_dict()
    for key in ("_name_or_path", "transformers_version"):
        config.pop(key, None)
    return {"base": str(base), "config_xxh3_64": xxhash.xxh3_64(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
            "weights_xxh3_64": _digest_tensors(base_state(model))}


class AdapterWeights(ModelWeights):
    """Checkpoints and the final model hold the adapter (see the module docstring)."""

    def __init__(self, merge: bool = False, source: Path | None = None):
        self.merge = merge
        self.source = source  # the base's folder; None: built from a config (saved to output_dir/base)
        self.fingerprint: dict[str, str] = {}

    def select(self, run, model_state):
        from peft import get_peft_model_state_dict

        # the rows of new tokens are in the adapter (trainable tokens, or the embeddings trained in full as
        # modules_to_save): not the whole resized embeddings again, which peft's "auto" adds
        embeddings = (run.model.get_input_embeddings(), run.model.get_output_embeddings())
        held = any(hasattr(module, "token_adapter") or hasattr(module, "modules_to_save") for module in embeddings)
        return get_peft_model_state_dict(run.model, state_dict=model_state,
                                         save_embedding_layers=False if held else "auto")

    def files(self, folder):
        return (ADAPTER_WEIGHTS, ADAPTER_CONFIG, FINGERPRINT)

    def write(self, run, folder, state, base_name: str | None = None):
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        save_file({name: tensor.detach().contiguous() for name, tensor in state.items()},
                  str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = copy.copy(run.model.peft_config[run.model.active_adapter])
        config.base_model_name_or_path = base_name
        config.save_pretrained(str(folder))
        (folder / FINGERPRINT).write_text(json.dumps(self.fingerprint, indent=1), encoding="utf-8")
        if hasattr(run.tokenizer, "save_pretrained"):
            run.tokenizer.save_pretrained(folder)

    def write_final(self, run, folder, state):
        final = run.output_dir.resolve()
        if self.source is not None:
            base_name = str(self.source.resolve())
        else:  # built from a config: the base's weights go with the adapter, once
            base_name = str(final / "base")
            _save_model(run, run.model.get_base_model(), base_state(run.model), folder / "base")
        self.write(run, folder, state, base_name)
        if self.merge:
            merged = copy.deepcopy(run.model).merge_and_unload()
            _save_model(run, merged, merged.state_dict(), folder / "merged")
            logger.info("peft: merged model written to %s", final / "merged")
        write_model_card(run, folder / "README.md", base_name)

    def load(self, run, model, folder, device):
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        self.check_base(folder)
        state = load_file(str(folder / ADAPTER_WEIGHTS), device=str(device))
        expected = set(self.select(run, model.state_dict()))
        if set(state) != expected:
            missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
            raise CheckpointError(f"checkpoint {folder}: the adapter does not match this run's (missing "
                                  f"{missing[:3] or 'none'}, unexpected {unexpected[:3] or 'none'}): its peft "
                                  "options differ")
        try:
            set_peft_model_state_dict(model, state)
        except RuntimeError as exc:  # shapes: another rank
            raise CheckpointError(f"checkpoint {folder}: the adapter does not fit this run's: {exc}") from None

    def check_base(self, folder: Path) -> None:
        """Refuse an adapter trained on another base, naming both."""
        try:
            saved = json.loads((folder / FINGERPRINT).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {folder}: cannot read {FINGERPRINT}: {exc}") from None
        differs = [part for part in ("config", "weights") if saved.get(f"{part}_xxh3_64") !=
                   self.fingerprint.get(f"{part}_xxh3_64")]
        if differs:
            raise CheckpointError(
                f"checkpoint {folder}: its adapter was trained on base {saved.get('base')!r} (config "
                f"{saved.get('config_xxh3_64')}, weights {saved.get('weights_xxh3_64')}), this run's base is "
                f"{self.fingerprint.get('base')!r} (config {self.fingerprint.get('config_xxh3_64')}, weights "
                f"{self.fingerprint.get('weights_xxh3_64')}): the {' and '.join(differs)} differ; resume with "
                "the checkpoint's base")


def _save_model(run: Any, model: torch.nn.Module, state: dict[str, torch.Tensor], folder: Path) -> None:
    """A full model in the save_pretrained layout, with the tokenizer."""
    from engine.kit.checkpoint import save_pretrained

    folder.mkdir(parents=True)
    save_pretrained(model, folder, state)
    if hasattr(run.tokenizer, "save_pretrained"):
        run.tokenizer.save_pretrained(folder)


def write_model_card(run: Any, path: Path, base_name: str) -> None:
    """README.md: the base, the adapter config and the final metrics."""
    config = run.model.peft_config[run.model.active_adapter].to_dict()
    metrics = {}
    for entry in run.state.log_history:
        metrics.update({key: value for key, value in entry.items() if key.startswith(("eval_", "train_"))
                        or key == "loss"})
    lines = ["---", "library_name: peft", f"base_model: {base_name}", "---", "",
             f"# {config['peft_type']} adapter", "",
             f"Base model: `{base_name}` ({run.config.train.model})", "",
             f"Trained by engine for {run.state.global_step} steps.", "", "## Adapter config", "", "```json",
             json.dumps({k: v for k, v in config.items() if v is not None}, indent=1, sort_keys=True, default=str),
             "```", "", "## Final metrics", ""]
    lines += [f"- {key}: {value}" for key, value in sorted(metrics.items())] or ["- (none logged)"]
    lines += ["", "## Use", "", "```python", "from peft import AutoPeftModelForCausalLM", "",
              f"model = AutoPeftModelForCausalLM.from_pretrained({str(run.output_dir.resolve())!r})", "```", ""]
    path.write_text("\n".join(lines), encoding="utf-8")
