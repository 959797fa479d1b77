"""The negative control of the equivalence test: DDP's processes, but gradients never synchronised."""

import contextlib

from engine_ddp import DDPStrategy

from engine import hookimpl


class UnsyncedDDP(DDPStrategy):
    name = "unsynced"

    def prepare_model(self, model):
        return model.to(self.device)  # not wrapped: each process keeps its own gradients

    def no_sync(self, model):
        return contextlib.nullcontext()


class Plugin:
    name = "unsynced"

    @hookimpl
    def register_strategies(self, register):
        register("unsynced", UnsyncedDDP)


plugin = Plugin()
