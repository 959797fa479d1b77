"""A TrainerCallback that stops the run from on_log, which fires on the main process only: the other
process must stop at the same step (not wait for it in the next collective)."""

from transformers import TrainerCallback


class StopOnLogAt3(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.global_step == 3:
            control.should_training_stop = True
