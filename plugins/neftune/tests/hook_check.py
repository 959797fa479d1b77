"""A plugin for the distributed NEFTune test: at the start of training every process checks that
NEFTune's forward hook sits on the input embeddings of the module the strategy calls."""

from engine import hookimpl


class Plugin:
    name = "hook_check"

    @hookimpl
    def on_train_start(self, run):
        embeddings = run.model.get_input_embeddings()
        hooks = list(embeddings._forward_hooks.values())
        if len(hooks) != 1 or "add_noise" not in hooks[0].__code__.co_names:
            raise RuntimeError(f"rank {run.strategy.rank}: NEFTune's hook is not on {type(embeddings).__name__}: {hooks}")
        # DDP and DeepSpeed wrap (.module); FSDP2 shards in place
        called = getattr(run.wrapped_model, "module", run.wrapped_model)
        if called.get_input_embeddings() is not embeddings:
            raise RuntimeError(f"the {run.strategy.name} strategy calls other embeddings than the hooked ones")


plugin = Plugin()
