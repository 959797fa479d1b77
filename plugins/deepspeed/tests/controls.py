"""Negative controls of the equivalence test: DeepSpeed strategies with one thing wrong each."""

from engine_deepspeed import DeepSpeedStrategy

from engine import hookimpl


class DividedTwice(DeepSpeedStrategy):
    """Lets DeepSpeed divide the loss by the accumulation steps again (its default, scale_wrt_gas)."""

    name = "divided_twice"

    def backward(self, loss):
        self.engine.set_gradient_accumulation_boundary(self._boundary)
        self.engine.backward(loss)


class Plugin:
    name = "controls"

    @hookimpl
    def register_strategies(self, register):
        register("divided_twice", DividedTwice)


plugin = Plugin()
