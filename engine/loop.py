"""The training loop. Every hook fires where this pseudocode says::

    Run(config)                                   # compose: plugin_options, register_optimizers,
                                                  #   register_schedulers, register_strategies
        configure(run)                            # refuse conflicts before anything loads
    train(run)
        strategy = create_strategy(run); strategy.setup()   # the process group, if any
        claim output_dir                          # (main process) lock it; fresh run or resume? a
                                                  #   checkpoint to resume is validated (a named one
                                                  #   fetched by locate_checkpoint first); another
                                                  #   run's folder is refused (engine/rundir.py)
        run.setup()
            tokenizer, datasets, model            # from [train] / [data], or given to Run
            undo = patch_model(run, model)        # each plugin, in order
            model = strategy.prepare_model(model)
            optimizer = create_optimizer(run); scheduler = create_scheduler(run, optimizer)
        if resuming: restore weights, optimizer, scheduler (changed hyper-parameters applied),
                     RNG, state
                     load_checkpoint_state(run, state)            # each plugin its own
        write the run record (output_dir/run.json)
        log_hyperparams(run, config)                              # main process
        on_train_start(run)
        on_train_mode(run)
        eval_on_start: evaluate(run)                              # not a candidate for the best model
        for epoch:
            on_epoch_start(run)
            for window of gradient_accumulation_steps micro-batches:
                out = training_step(run, batches, num_items)      # builtin: per micro-batch
                                                                  #   compute_loss + backward,
                                                                  #   clip, optimizer.step
                scheduler.step()
                on_step_end(run)                                  # may set run.control flags
                every logging_steps:  log_metrics(run, metrics, step)   # logging_strategy "steps"
                every eval_steps:     evaluate(run)               # see below; best metric noted;
                                                                  #   then on_train_mode; from eval_delay on
                every save_steps:     save(run)                   # see below, then on_train_mode;
                                                                  #   "best": after an evaluation that improved
                (run.control.should_log / should_evaluate / should_save: log / evaluate / save too;
                 what the logging hooks request on the main process applies on every process)
                SIGTERM with enable_jit_checkpoint: save(run), raise TrainingPreempted (exit 143)
                if run.control.should_stop or step == max_steps: stop
                if run.control.should_epoch_stop: end the epoch
            on_epoch_end(run)
            logging_strategy / eval_strategy / save_strategy "epoch": log / evaluate / save
        on_eval_mode(run)
        load_best_model_at_end: load the best checkpoint's weights
        save_final_model: model (+ tokenizer) into output_dir, atomically
        on_train_end(run)
        undo patches (reverse order)
        log_finish(run, status)                                   # also when training raised
        record the status (finished, failed, diverged, interrupted); unlock output_dir

    evaluate(run)
        on_eval_mode(run)
        for batch: compute_loss(run, model, batch, num_items)     # no_grad
                   predict_with_generate: model.generate(batch)   # the predictions compute_metrics gets
        log_metrics(run, eval_metrics, step); on_evaluate(run, eval_metrics)

    predict(run, dataset)                         # as evaluate, but the metrics are returned, not
        on_predict(run, test_metrics)             #   logged (as Trainer.predict)

    save(run)
        on_eval_mode(run)
        checkpoint_state(run)                                     # each plugin its own
        write output_dir/checkpoint-<step>/ atomically; rotate (save_total_limit)
        on_checkpoint_saved(run, path)

Divergence: the losses and gradient norms stay tensors until the loop reads them anyway (a log
step, an evaluation, a save, the end); there they are checked, and a nan or inf stops the run
(``TrainingDiverged``) before anything non-finite is saved. ``train.on_nonfinite = "skip"``
instead skips such updates in the builtin step (one host sync per step).

Per-step work is kept to what a hand-written loop does: hook callers are looked up once, the
loss stays a tensor until a log step (no host sync per step), nothing is allocated per step
beyond the batches themselves.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import math
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from . import autobatch, checkpoint, memory, rundir
from .errors import ConfigError, TrainingDiverged, TrainingPreempted
from .loss import IGNORE_INDEX, count_items, logits_of
from .state import EpochSampler, PredictionOutput
from .util import call_user

if TYPE_CHECKING:
    from .run import Run

logger = logging.getLogger("engine")


def train(run: Run) -> dict[str, float]:
    run.setup_strategy()  # the process group first: the main process decides the claim for all
    try:
        autobatch.check(run)
        claim = rundir.claim(run)  # before anything loads: a busy folder or a bad checkpoint stops us here
    except BaseException:
        run.strategy.teardown()
        raise
    run.run_id = claim.run_id
    status = "failed"
    try:
        summary = _train(run, claim)
        status = "finished"
        return summary
    except TrainingDiverged:
        status = "diverged"
        raise
    except (KeyboardInterrupt, TrainingPreempted):
        status = "interrupted"
        raise
    finally:
        run.remove_patches()  # also when setup or the resume failed after patch_model
        claim.finish(status, run.isolated_hooks.failed)


def _train(run: Run, claim: rundir.Claim) -> dict[str, float]:
    resume_from = claim.resume_from
    run.setup()
    hook, state, control, strategy = run.hook, run.state, run.control, run.strategy
    train_cfg = run.config.train
    main = strategy.is_main_process
    accumulation = train_cfg.gradient_accumulation_steps
    state.max_steps = run.num_training_steps
    from .data import no_evaluation_data, schedules_evaluation

    if run.eval_dataset is None and schedules_evaluation(train_cfg):
        raise no_evaluation_data(train_cfg)  # now, not at the first evaluation an epoch later
    if resume_from is not None:
        checkpoint.load(run, resume_from)
    claim.start(run)
    tracker = memory.track(run, "train")
    logged = _Interval(run)

    def evaluate_now() -> None:
        logged.stop_if_diverged()
        checkpoint.note_evaluation(run, evaluate(run))
        if distributed:
            _share_requests(run)
        hook.on_train_mode(run=run)
        if train_cfg.save_strategy == "best" and state.best_global_step == state.global_step:
            save_now()  # a new best metric, as Trainer's save_strategy "best"

    saved_step = state.global_step if resume_from is not None else -1

    def save_now() -> None:
        nonlocal saved_step
        if saved_step != state.global_step:  # e.g. a save_steps save that is also an epoch's end
            logged.stop_if_diverged()
            checkpoint.save(run)
            saved_step = state.global_step
        hook.on_train_mode(run=run)

    distributed = strategy.world_size > 1
    eval_every = (train_cfg.eval_steps or train_cfg.logging_steps) if train_cfg.eval_strategy == "steps" else 0
    eval_delay = train_cfg.eval_delay
    save_every = train_cfg.save_steps if train_cfg.save_strategy == "steps" else 0
    log_every = train_cfg.logging_steps if train_cfg.logging_strategy == "steps" else 0
    log_first = train_cfg.logging_first_step

    def log_now() -> None:
        control.should_log = False
        metrics = logged.flush(lr)
        if main:
            run.isolated_hooks.call("log_metrics", metrics=metrics, step=state.global_step)
        if distributed:
            _share_requests(run)
        logged.stop_if_diverged()

    # hook callers looked up once: the per-step cost is pluggy's dispatch only
    training_step, on_step_end = hook.training_step, hook.on_step_end
    shift = run.label_shift
    non_padding = train_cfg.include_num_input_tokens_seen == "non_padding"  # a tensor sum: no host sync
    empty_cache_every = train_cfg.torch_empty_cache_steps
    restart: autobatch.Restart | None = None  # train.auto_find_batch_size: how the run started

    lr = float(run.optimizer.param_groups[0]["lr"])
    sigterm = _Sigterm() if train_cfg.enable_jit_checkpoint else None
    status = "failed"
    start_time = time.perf_counter()
    start_step, tokens_at_start = state.global_step, state.num_input_tokens_seen

    def train_epochs() -> None:
        nonlocal lr
        # what the batch size decides: set again when auto_find_batch_size starts the run again
        steps_per_epoch = state.steps_per_epoch  # 0 for an IterableDataset: an epoch ends when it does
        num_epochs = math.ceil(state.max_steps / steps_per_epoch) if steps_per_epoch else None
        sampler = run.train_loader.sampler if hasattr(run.train_loader.sampler, "set_epoch") else None
        scheduler_step = run.scheduler.step
        optimizer = run.optimizer
        skipped_in_a_row = 0
        first_epoch = state.global_step // steps_per_epoch if steps_per_epoch else 0
        for epoch in itertools.count(first_epoch) if num_epochs is None else range(first_epoch, num_epochs):
            if state.global_step >= state.max_steps:
                break
            # steps of this epoch trained before a resume: their batches are skipped, unless
            # ignore_data_skip (as Trainer: the resumed epoch's data from its start)
            done_in_epoch = state.global_step - epoch * steps_per_epoch \
                if steps_per_epoch and not train_cfg.ignore_data_skip else 0
            if sampler is not None:
                sampler.set_epoch(epoch, done_in_epoch * accumulation * train_cfg.per_device_train_batch_size)
            run.train_loader.generator.manual_seed(train_cfg.seed + epoch)  # worker seeds per epoch
            state.epoch = float(epoch) + (done_in_epoch / steps_per_epoch if steps_per_epoch else 0.0)
            control.should_epoch_stop = False
            hook.on_epoch_start(run=run)
            batches = iter(run.train_loader)
            step_in_epoch = done_in_epoch
            while True:
                window = [strategy.to_device(b) for b in itertools.islice(batches, accumulation)]
                if not window:
                    break
                # a lone micro-batch's mean loss is already the window's mean: no count needed;
                # with several processes, the count of the global batch (its losses then add up
                # over processes to the global mean, whatever padding each process got)
                num_items = None
                if (len(window) > 1 or distributed) and "labels" in window[0]:
                    num_items = sum(count_items(batch["labels"], shift) for batch in window)
                    if distributed:
                        num_items = strategy.reduce(num_items, "sum")
                logged.tokens += sum(b["attention_mask"].sum() if non_padding and "attention_mask" in b
                                     else b["input_ids"].numel() for b in window if "input_ids" in b)

                lr = float(optimizer.param_groups[0]["lr"])  # a tensor for some optimizers (torchao)
                try:  # free unless raised (zero-cost exceptions)
                    out = training_step(run=run, batches=window, num_items_in_batch=num_items)
                except RuntimeError as exc:
                    if restart is not None and autobatch.is_out_of_memory(exc):
                        raise autobatch.StepOutOfMemory() from exc
                    raise
                if empty_cache_every and state.global_step % empty_cache_every == 0:  # Trainer's steps 0, N, 2N ...
                    memory.empty_device_cache()
                scheduler_step()
                state.global_step += 1
                step_in_epoch += 1
                state.epoch = epoch + (step_in_epoch / steps_per_epoch if steps_per_epoch else 0.0)
                logged.add(out)
                if out.skipped:
                    skipped_in_a_row += 1
                    _note_skipped(run, out, skipped_in_a_row)
                else:
                    skipped_in_a_row = 0
                on_step_end(run=run)

                step = state.global_step
                last = step >= state.max_steps
                if (log_every and (step % log_every == 0 or last)) or (log_first and step == 1) or control.should_log:
                    log_now()
                if (eval_every and step % eval_every == 0 and step >= eval_delay) or control.should_evaluate:
                    control.should_evaluate = False
                    evaluate_now()
                if (save_every and step % save_every == 0) or control.should_save:
                    control.should_save = False
                    save_now()
                if sigterm is not None and sigterm.received(strategy):
                    save_now()
                    raise TrainingPreempted(f"stopped by SIGTERM at step {step} (train.enable_jit_checkpoint): saved "
                                            f"{run.output_dir / f'checkpoint-{step}'}; resume with "
                                            "train.resume_from_checkpoint = true")
                if control.should_stop or last or control.should_epoch_stop:
                    break
            hook.on_epoch_end(run=run)
            if (train_cfg.logging_strategy == "epoch" or control.should_log) and logged.count:
                log_now()
            if (train_cfg.eval_strategy == "epoch" and state.epoch >= eval_delay) or control.should_evaluate:
                control.should_evaluate = False
                evaluate_now()
            if train_cfg.save_strategy == "epoch" or control.should_save:
                control.should_save = False
                save_now()
            if control.should_stop:
                break

    if main:
        run.isolated_hooks.call("log_hyperparams", params=run.config.to_mapping())
    try:
        hook.on_train_start(run=run)
        hook.on_train_mode(run=run)
        if train_cfg.eval_on_start:  # as Trainer: reported, but not a candidate for the best model
            evaluate(run)
            hook.on_train_mode(run=run)
        if train_cfg.auto_find_batch_size:
            restart = autobatch.Restart(run, resume_from)
        while True:
            try:
                train_epochs()
                break
            except autobatch.StepOutOfMemory as exc:
                restart.with_smaller_batch(exc.__cause__)
                logged, saved_step = _Interval(run), restart.start_step if resume_from is not None else -1
        if control.should_stop and state.global_step < state.max_steps:
            logger.info("stopped at step %d of %d: %s", state.global_step, state.max_steps,
                        control.stop_reason or "a plugin set run.control.should_stop")
        if logged.count and train_cfg.logging_strategy == "steps":  # steps since the last log, when a plugin stopped the run
            log_now()
        logged.stop_if_diverged()
        logged.count_tokens()  # those not logged (logging_strategy "no" or "epoch")
        runtime = time.perf_counter() - start_time
        steps = state.global_step - start_step
        tokens = state.num_input_tokens_seen - tokens_at_start
        summary = {
            "train_runtime": round(runtime, 4),
            "train_steps_per_second": round(steps / runtime, 3) if runtime else 0.0,
            "train_tokens_per_second": round(tokens / runtime, 1) if runtime else 0.0,  # as include_tokens_per_second
            "train_loss": logged.mean_loss,
        }
        memory.finish(run, tracker, summary)
        if main:
            run.isolated_hooks.call("log_metrics", metrics=summary, step=state.global_step)
        hook.on_eval_mode(run=run)
        if train_cfg.load_best_model_at_end:
            checkpoint.load_best_model(run)
        if train_cfg.save_final_model:
            checkpoint.save_final_model(run)
        hook.on_train_end(run=run)
        status = "success"
        return summary
    finally:
        memory.finish(run, tracker)  # a failed run: the watcher stops
        if sigterm is not None:
            sigterm.restore()
        run.remove_patches()
        if main:
            run.isolated_hooks.call("log_finish", status=status)
            run.isolated_hooks.report()
        strategy.teardown()


class _Sigterm:
    """``train.enable_jit_checkpoint``: a SIGTERM asks for a checkpoint at the end of the current step.

    With several processes, the flag is summed over them every step (one small all-reduce), so all
    save the same step even when the signal reaches them at different moments.
    """

    def __init__(self):
        self.flag = False
        in_main_thread = threading.current_thread() is threading.main_thread()  # only it may set handlers
        self.previous = signal.signal(signal.SIGTERM, self._handle) if in_main_thread else None

    def _handle(self, signum: int, frame: Any) -> None:
        self.flag = True

    def received(self, strategy: Any) -> bool:
        if strategy.world_size == 1:
            return self.flag
        return bool(strategy.reduce(torch.tensor(float(self.flag), device=strategy.device), "sum") > 0)

    def restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


class _Interval:
    """Sums over the current logging interval, and the divergence check.

    Each step's loss and gradient norm stay tensors (no host sync per step) until the loop
    reads them anyway: a log step, an evaluation, a save, the end (or every ``READ_EVERY``
    steps). There they are read in one go and checked: the first nan or inf is kept, and
    :meth:`stop_if_diverged` raises it. With fp16 loss scaling, non-finite gradient norms are
    the scaler's business (it skips those steps), so only the loss counts then.
    """

    READ_EVERY = 1000  # a long logging interval keeps no long list of tensors

    def __init__(self, run: Run):
        self.run = run
        self.state = run.state
        self.check_grad_norm = not run.strategy.scales_loss
        self.log_skipped = run.config.train.on_nonfinite == "skip"
        self.log_tokens_seen = run.config.train.include_num_input_tokens_seen != "no"
        self.pending: list[tuple[int, torch.Tensor, Any]] = []
        self.divergence: tuple[str, int] | None = None
        self.count = 0  # steps since the last flush, skipped ones included
        self.loss = 0.0
        self.steps = 0  # steps read and summed into self.loss
        self.tokens = 0
        self.grad_norm: float | None = None
        self.started = time.perf_counter()
        self.total_loss = 0.0
        self.total_steps = 0

    def add(self, out: Any) -> None:
        self.count += 1
        if out.skipped:  # its loss is nan or inf: not part of the interval's mean
            return
        self.pending.append((self.state.global_step, out.loss.detach(), out.grad_norm))
        if len(self.pending) >= self.READ_EVERY:
            self.read()

    def read(self) -> None:
        """Move the pending values to the host (one sync) and look for the first non-finite one."""
        if not self.pending:
            return
        steps, losses, norms = zip(*self.pending)
        self.pending = []
        # the mean over processes: every process logs and decides on the same numbers
        loss_values = self.run.strategy.reduce(torch.stack([loss.float() for loss in losses]), "mean").tolist()
        norm_values = _host_values(norms)
        for step, loss, norm in zip(steps, loss_values, norm_values):
            if self.divergence is not None:
                break
            if not math.isfinite(loss):
                self.divergence = (f"the loss is {loss}", step)
            elif self.check_grad_norm and norm is not None and not math.isfinite(norm):
                self.divergence = (f"the gradient norm is {norm}", step)
        self.loss += sum(loss_values)
        self.steps += len(loss_values)
        if norm_values[-1] is not None:
            self.grad_norm = norm_values[-1]

    def stop_if_diverged(self) -> None:
        self.read()
        if self.divergence is not None:
            what, step = self.divergence
            raise checkpoint.diverged(self.run, what, step)

    def flush(self, lr: float) -> dict[str, float]:
        self.read()
        now = time.perf_counter()
        elapsed = now - self.started
        loss = self.loss / self.steps if self.steps else math.nan
        self.total_loss += self.loss
        self.total_steps += self.steps
        tokens = self.count_tokens()
        metrics = {"loss": round(loss, 6), "learning_rate": lr}
        if self.grad_norm is not None:
            metrics["grad_norm"] = round(self.grad_norm, 6)
        metrics.update({
            "tokens_per_second": round(tokens / elapsed, 1) if elapsed else 0.0,
            "step_time": round(elapsed / max(self.count, 1), 6),
            "epoch": round(self.state.epoch, 4),
        })
        if self.log_tokens_seen:
            metrics["num_input_tokens_seen"] = self.state.num_input_tokens_seen
        if self.log_skipped:
            metrics["skipped_steps"] = self.state.num_skipped_steps
        self.state.log_history.append({"step": self.state.global_step, **metrics})
        self.loss, self.steps, self.count, self.started = 0.0, 0, 0, now
        return metrics

    def count_tokens(self) -> int:
        """Move this interval's input tokens (every process's) to ``state.num_input_tokens_seen``."""
        tokens = self.tokens
        if self.run.strategy.world_size > 1:  # a sync, where the loop syncs anyway
            tokens = self.run.strategy.reduce(torch.as_tensor(tokens, dtype=torch.float64), "sum")
        self.tokens = 0
        self.state.num_input_tokens_seen += int(tokens)
        return int(tokens)

    @property
    def mean_loss(self) -> float:
        steps = self.total_steps + self.steps  # with the steps read but not logged (logging_strategy "no")
        return round((self.total_loss + self.loss) / steps, 6) if steps else float("nan")


def _share_requests(run: Run) -> None:
    """The main process's control requests, on every process too: the logging hooks run on the main
    process only, and what one asks for (a TrainerCallback's on_log stopping the run) must happen on
    all, or the others would wait for it in the next collective."""
    control = run.control
    requests = (control.should_stop, control.stop_reason, control.should_save, control.should_evaluate,
                control.should_epoch_stop)
    should_stop, stop_reason, should_save, should_evaluate, should_epoch_stop = run.strategy.broadcast_object(requests)
    if should_stop and not control.should_stop:
        control.request_stop(stop_reason)
    control.should_save |= should_save
    control.should_evaluate |= should_evaluate
    control.should_epoch_stop |= should_epoch_stop


def _host_values(values: tuple[Any, ...]) -> list[float | None]:
    """Floats for tensors (read in one sync), numbers and None."""
    out = [None if v is None or isinstance(v, torch.Tensor) else float(v) for v in values]
    tensors = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    if tensors:
        for i, value in zip(tensors, torch.stack([values[i].float() for i in tensors]).tolist()):
            out[i] = value
    return out


def _note_skipped(run: Run, out: Any, in_a_row: int) -> None:
    """Count a skipped update (``on_nonfinite = "skip"``); stop after too many in a row."""
    state, limit = run.state, run.config.train.max_skipped_in_a_row
    state.num_skipped_steps += 1
    norm = "-" if out.grad_norm is None else float(out.grad_norm)
    logger.warning("step %d: loss %s, gradient norm %s: update skipped (%d in a row, %d in total)",
                   state.global_step, float(out.loss), norm, in_a_row, state.num_skipped_steps)
    if in_a_row >= limit:
        raise checkpoint.diverged(run, f"{in_a_row} updates in a row had a nan or inf loss or gradient norm "
                                       f"(train.max_skipped_in_a_row = {limit})")


def evaluate(run: Run, dataset: Any = None, prefix: str = "eval", report: bool = True) -> dict[str, float]:
    """Evaluate ``dataset`` (default: the run's eval data; a dict evaluates each, prefixed).

    ``report``: send the metrics to ``log_metrics`` and ``on_evaluate`` (``engine evaluate``, a
    job of its own, does not).
    """
    dataset = dataset if dataset is not None else run.eval_dataset
    if dataset is None:
        raise ConfigError("no evaluation data: set data.eval or data.eval_split, or pass eval_dataset")
    metrics: dict[str, float] = {}
    tracker = memory.track(run, "eval")  # None during training, as Trainer
    try:
        run.hook.on_eval_mode(run=run)
        parts = dataset.items() if isinstance(dataset, dict) else [(None, dataset)]
        for name, part in parts:
            part_metrics, _, _ = _evaluate_one(run, part, f"{prefix}_{name}" if name else prefix,
                                               want_predictions=False)
            metrics.update(part_metrics)
        metrics = _report(run, metrics) if report else {**metrics, "epoch": round(run.state.epoch, 4)}
    finally:
        memory.finish(run, tracker, metrics)  # returned, not logged, as Trainer
    return metrics


def cast_for_full_eval(run: Run) -> None:
    """``bf16_full_eval`` / ``fp16_full_eval``: cast the model in place before an evaluation or prediction
    outside training (Run.evaluate, Run.predict, ``engine evaluate``), as Trainer does."""
    train = run.config.train
    if train.bf16_full_eval:
        if run.strategy.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError("train.bf16_full_eval: this GPU does not support bfloat16; use train.fp16_full_eval")
        run.model.to(torch.bfloat16)
    elif train.fp16_full_eval:
        run.model.to(torch.float16)


def predict(run: Run, dataset: Any, prefix: str = "test") -> Any:
    """Logits, labels and metrics over ``dataset`` (see :meth:`Run.predict`)."""

    tracker = memory.track(run, "test")
    metrics: dict[str, float] = {}
    try:
        run.hook.on_eval_mode(run=run)
        measured, predictions, label_ids = _evaluate_one(run, dataset, prefix, want_predictions=True)
        # returned, not logged (as Trainer.predict); not an evaluation, which early stopping counts
        metrics.update(measured, epoch=round(run.state.epoch, 4))
        run.hook.on_predict(run=run, metrics=metrics)
    finally:
        memory.finish(run, tracker, metrics)  # returned, not logged, as Trainer
    return PredictionOutput(predictions, label_ids, metrics)


def _report(run: Run, metrics: dict[str, float]) -> dict[str, float]:
    state = run.state
    metrics["epoch"] = round(state.epoch, 4)
    state.log_history.append({"step": state.global_step, **metrics})
    if run.strategy.is_main_process:
        run.isolated_hooks.call("log_metrics", metrics=metrics, step=state.global_step)
    run.hook.on_evaluate(run=run, metrics=metrics)
    return metrics


def _evaluate_one(run: Run, dataset: Any, prefix: str, want_predictions: bool) -> tuple[dict[str, float], Any, Any]:
    """Token-weighted loss (and compute_metrics) over ``dataset``; logits and labels when wanted.

    Logits come from the forward that ``compute_loss`` runs (caught by a forward hook), so
    predictions cost no second forward pass. With ``train.predict_with_generate`` the predictions
    are ``generate()``'s token ids instead, as Seq2SeqTrainer's (engine/tasks.py).
    """

    strategy, model, train_cfg = run.strategy, run.wrapped_model, run.config.train
    dataset, collator = run.loader_data(dataset, f"{prefix} dataset")
    sampler = None
    length = 0
    if not isinstance(dataset, torch.utils.data.IterableDataset):
        length = len(dataset)
        # every process gets an equal share (sharded models need the same forwards everywhere),
        # so up to world_size - 1 samples repeat at the end: their labels are masked below
        sampler = EpochSampler(length, 0, False, strategy.rank, strategy.world_size)
    loader = torch.utils.data.DataLoader(dataset, batch_size=train_cfg.per_device_eval_batch_size,
                                         sampler=sampler, collate_fn=collator, **run.loader_options(),
                                         generator=torch.Generator().manual_seed(train_cfg.seed))
    compute_loss, on_prediction_step = run.hook.compute_loss, run.hook.on_prediction_step
    total = len(loader) if sampler is not None else None
    use_metrics = run.compute_metrics is not None and not train_cfg.prediction_loss_only
    collect = use_metrics or (want_predictions and not train_cfg.prediction_loss_only)
    generation = None
    if collect and train_cfg.predict_with_generate:
        from .tasks import generation as generation_settings

        generation = generation_settings(train_cfg, run.model)
        pad_id = getattr(run.tokenizer, "pad_token_id", None)
        pad_id = pad_id if pad_id is not None else getattr(run.model.config, "pad_token_id", None) or 0
    want_logits = collect and generation is None
    outputs: list[Any] = []
    handle = model.register_forward_hook(lambda module, args, output: outputs.append(output)) if want_logits else None
    loss_sum = torch.zeros((), dtype=torch.float64)
    weight_sum = torch.zeros((), dtype=torch.float64)
    predictions, label_ids = [], []
    label_names = run.label_names
    # train.include_for_metrics: the model's main inputs and each row's batch loss, as Trainer
    inputs: list[torch.Tensor] = []
    losses: list[torch.Tensor] = []
    include = set(train_cfg.include_for_metrics) if use_metrics else set()
    main_input = getattr(run.model, "main_input_name", "input_ids")
    # train.batch_eval_metrics: compute_metrics sees each batch (tensors), compute_result=True for the last;
    # its last answer is the metrics. Batches are kept only for predict's output then.
    per_batch = use_metrics and train_cfg.batch_eval_metrics
    if per_batch:
        function = run.compute_metrics
        if "compute_result" not in _parameters(function):
            raise ConfigError(f"train.batch_eval_metrics: {run.compute_metrics_key} must take a compute_result "
                              "argument (true after the last batch: return the metrics then)")
        if strategy.world_size > 1:
            raise ConfigError("train.batch_eval_metrics: not supported with several processes yet (each would see "
                              "its own batches only); set it to false")
    keep = not per_batch or want_predictions
    pending = computed = None
    samples = 0
    started = time.perf_counter()
    try:
        with torch.no_grad():
            for index, batch in enumerate(loader, 1):
                batch = strategy.to_device(batch)
                rows = len(next(iter(batch.values())))
                if sampler is not None and strategy.world_size > 1 and "labels" in batch:
                    positions = strategy.rank + strategy.world_size * torch.arange(samples, samples + rows)
                    if bool((positions >= length).any()):  # a repeat: no loss, no items
                        batch["labels"] = batch["labels"].clone()
                        batch["labels"][(positions >= length).to(batch["labels"].device)] = IGNORE_INDEX
                num_items = count_items(batch["labels"], run.label_shift) if "labels" in batch else None
                outputs.clear()
                with strategy.autocast():
                    loss = compute_loss(run=run, model=model, batch=batch, num_items_in_batch=num_items)
                    if want_logits and not outputs:  # a loss plugin that did not call the model
                        model(**batch)
                    if generation is not None:
                        from .tasks import generate

                        outputs.append(generate(run.model, batch, generation, pad_id))
                weight = num_items if num_items is not None else rows
                if float(weight) > 0:  # a batch of repeats only has no loss to add
                    loss_sum += loss.detach().double().cpu() * float(weight)
                weight_sum += float(weight)
                samples += rows
                if collect:
                    labels = _labels_of(batch, label_names)
                    if generation is not None:
                        found = outputs[-1]
                    else:
                        found = _predictions_of(run.model, outputs[-1])
                        if run.preprocess_logits_for_metrics is not None:  # e.g. argmax: keep less per batch
                            found = run.preprocess_logits_for_metrics(found, labels)
                    batch_inputs = batch[main_input] if "inputs" in include else None
                    batch_losses = loss.detach().float().repeat(rows) if "loss" in include else None
                    if per_batch:
                        if pending is not None:
                            computed = _call_metrics(run, pending, compute_result=False)
                        pending = EvalPrediction(found, labels, batch_inputs, batch_losses)
                    if keep:
                        as_is = generation is not None or run.preprocess_logits_for_metrics is not None
                        predictions.append(_nested(lambda t: t.cpu() if as_is else t.float().cpu(), found))
                        if labels is not None:
                            label_ids.append(_nested(lambda t: t.cpu(), labels))
                        if batch_inputs is not None:
                            inputs.append(batch_inputs.cpu())
                        if batch_losses is not None:
                            losses.append(batch_losses.cpu())
                on_prediction_step(run=run, step=index, total=total)
        if pending is not None:
            computed = _call_metrics(run, pending, compute_result=True)
    finally:
        if handle is not None:
            handle.remove()
    loss_sum = strategy.reduce(loss_sum.to(strategy.device), "sum").cpu()
    weight_sum = strategy.reduce(weight_sum.to(strategy.device), "sum").cpu()
    runtime = time.perf_counter() - started
    metrics = {
        f"{prefix}_loss": round(float(loss_sum / weight_sum), 6) if weight_sum > 0 else float("nan"),
        f"{prefix}_runtime": round(runtime, 4),
        f"{prefix}_samples_per_second": round(samples / runtime, 3) if runtime else 0.0,
    }
    if not collect:
        return metrics, None, None
    all_predictions = _concat_nested(predictions) if predictions else None
    all_labels = _concat_nested(label_ids) if label_ids else None
    all_inputs = _concat_padded(inputs) if inputs else None
    all_losses = torch.cat(losses).numpy() if losses else None
    if strategy.world_size > 1 and sampler is not None:
        all_predictions, all_labels, all_inputs, all_losses = _gather_in_order(
            strategy, (all_predictions, all_labels, all_inputs, all_losses), length)
    if use_metrics and not per_batch:
        computed = _call_metrics(run, EvalPrediction(all_predictions, all_labels, all_inputs, all_losses))
    for key, value in (computed or {}).items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:  # batch_eval_metrics' tensors, as Trainer
            value = value.item()
        metrics[key if key.startswith(prefix + "_") else f"{prefix}_{key}"] = value
    return metrics, all_predictions, all_labels


def _parameters(function: Any) -> Any:
    try:
        return inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature (a builtin)
        return {}


def _call_metrics(run: Run, prediction: EvalPrediction, **keywords: Any) -> dict[str, Any]:
    """compute_metrics on ``prediction``; its answer checked to be a dict of metric name -> value."""
    function = run.compute_metrics
    name = run.config.train.compute_metrics if run.compute_metrics_key == "train.compute_metrics" else \
        getattr(function, "__qualname__", type(function).__name__)
    computed = call_user(run.compute_metrics_key, name, functools.partial(function, **keywords) if keywords
                         else function, prediction)
    if not isinstance(computed, dict) or not all(isinstance(k, str) for k in computed):
        raise ConfigError(f"{run.compute_metrics_key}: {name} returned {type(computed).__name__}, expected a dict "
                          "of metric name -> number")
    return computed


def _gather_in_order(strategy: Any, arrays: tuple[Any, ...], length: int) -> tuple[Any, ...]:
    """Every process's rows of each of ``arrays`` (None stays None), back in dataset order, without the
    repeats of the equal shares.

    Process r holds rows r, r + world_size, r + 2 * world_size, ... of the dataset.
    """
    import numpy

    parts = strategy.gather_object(arrays)
    world = strategy.world_size

    def merged(arrays: list[Any]) -> Any:
        width = max(a.shape[1] for a in arrays) if arrays[0].ndim > 1 else None
        out = None
        for rank, array in enumerate(arrays):
            if width is not None and array.shape[1] < width:  # ragged sequences: pad as _concat_padded does
                pad = [(0, 0), (0, width - array.shape[1])] + [(0, 0)] * (array.ndim - 2)
                array = numpy.pad(array, pad, constant_values=-100)
            if out is None:
                out = numpy.empty((length, *array.shape[1:]), dtype=array.dtype)
            rows = numpy.arange(rank, rank + world * len(array), world)
            keep = rows < length
            out[rows[keep]] = array[keep]
        return out

    def merged_nested(arrays: list[Any]) -> Any:  # a tuple (several outputs or label names): element by element
        if isinstance(arrays[0], tuple):
            return tuple(merged([array[i] for array in arrays]) for i in range(len(arrays[0])))
        return merged(arrays)

    return tuple(None if array is None else merged_nested([part[i] for part in parts])
                 for i, array in enumerate(arrays))


class EvalPrediction(tuple):
    """``(predictions, label_ids)`` as numpy arrays, like transformers.EvalPrediction; then ``inputs`` and
    ``losses`` when train.include_for_metrics asks for them."""

    def __new__(cls, predictions: Any, label_ids: Any, inputs: Any = None, losses: Any = None):
        prediction = super().__new__(cls, (predictions, label_ids, *(v for v in (inputs, losses) if v is not None)))
        prediction.inputs, prediction.losses = inputs, losses
        return prediction

    @property
    def predictions(self) -> Any:
        return self[0]

    @property
    def label_ids(self) -> Any:
        return self[1]


def _predictions_of(model: Any, outputs: Any) -> Any:
    """The model's logits; for an output without ``logits`` (e.g. question answering's start_logits and
    end_logits) a tuple of its tensors but the loss and the config's keys_to_ignore_at_inference, as Trainer."""
    if isinstance(outputs, dict) and outputs.get("logits") is None:
        ignore = getattr(getattr(model, "config", None), "keys_to_ignore_at_inference", None) or []
        found = tuple(v.detach() for k, v in outputs.items() if k not in (*ignore, "loss") and torch.is_tensor(v))
        return found[0] if len(found) == 1 else found
    return logits_of(outputs).detach()


def _labels_of(batch: dict[str, Any], names: list[str]) -> Any:
    """The batch's labels under train.label_names (a tuple for several names); None unless all are there."""
    if not names or any(batch.get(name) is None for name in names):
        return None
    return batch[names[0]] if len(names) == 1 else tuple(batch[name] for name in names)


def _nested(function: Callable[[torch.Tensor], Any], value: Any) -> Any:
    return tuple(function(v) for v in value) if isinstance(value, tuple) else function(value)


def _concat_nested(items: list[Any]) -> Any:
    """:func:`_concat_padded` of each batch's tensors, or of each element of their tuples (a tuple then)."""
    if isinstance(items[0], tuple):
        return tuple(_concat_padded([item[i] for item in items]) for i in range(len(items[0])))
    return _concat_padded(items)


def _concat_padded(tensors: list[torch.Tensor]) -> Any:
    """Concatenate along dim 0, right-padding dim 1 with -100 when lengths differ; numpy out."""
    if tensors[0].dim() > 1:
        width = max(t.shape[1] for t in tensors)
        tensors = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1]), value=-100)
                   if t.shape[1] < width else t for t in tensors]
    return torch.cat(tensors).numpy()
