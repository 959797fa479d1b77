"""The training loop. Every hook fires where this pseudocode says::

    Run(config)                                   # compose: plugin_options, register_optimizers,
                                                  #   register_schedulers, register_strategies
        configure(run)                            # refuse conflicts before anything loads
    train(run)
        strategy = create_strategy(run); strategy.setup()   # the process group, if any
        claim output_dir                          # (main process) lock it; fresh run or resume? a
                                                  #   checkpoint to resume: resolve_checkpoint(run,
                                                  #   run_id) (a named one fetched by
                                                  #   locate_checkpoint), check_checkpoint(run, path);
                                                  #   another run's folder is refused (engine/rundir.py)
        run.setup()
            tokenizer, datasets, model            # from [train] / [data], or given to Run
            undo = patch_model(run, model)        # each plugin, in order
            model = strategy.prepare_model(model)
            train_loader = create_train_loader(run)
            optimizer = create_optimizer(run); scheduler = create_scheduler(run, optimizer)
        if resuming: restore_checkpoint(run, path)                # weights, optimizer, scheduler (changed
                     #   hyper-parameters applied), RNG, state
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
                on_step_end(run)                                  # sets run.control: first the builtin
                                                                  #   flow (logging_/eval_/save_ strategy,
                                                                  #   steps, eval_delay), then any plugin
                what run.control asks:
                    should_log:      log_metrics(run, metrics, step)
                    should_evaluate: evaluate(run), then on_train_mode      # on_evaluate: the best
                                                                  #   model builtin notes the metric
                                                                  #   ("best" saving: should_save)
                    should_save:     save(run), then on_train_mode
                    abort:           raise it (SIGTERM with enable_jit_checkpoint: TrainingPreempted,
                                     exit 143, after the save it asked for)
                (what the logging hooks request on the main process applies on every process)
                if run.control.should_stop or step == max_steps: stop
                if run.control.should_epoch_stop: end the epoch
            on_epoch_end(run)                                     # the flow: "epoch" strategies
            what run.control asks: log / evaluate / save
        RestartTraining raised by a training step (auto_find_batch_size: out of memory):
            run.state, run.control fresh; loader, optimizer, scheduler made again
            on_restart(run)                                       # each plugin its own state
            resuming: load the checkpoint again
            the epochs again from the start
        summary (train_runtime, train_loss, ...); on_train_summary(run, summary); log_metrics
        on_eval_mode(run)
        on_before_final_save(run)                                 # load_best_model_at_end
        save_final_model: model (+ tokenizer) into output_dir, atomically
        on_train_end(run)
        on_train_exit(run, status)                                # also when training raised
        undo patches (reverse order)
        log_finish(run, status)                                   # also when training raised
        record the status (finished, failed, diverged, interrupted, pruned); unlock output_dir

    evaluate(run, dataset, prefix, report, in_training)           # builtin: engine/builtin/evaluation.py
        on_eval_mode(run)
        for batch: prediction_step(run, model, batch, ...)        # no_grad: loss, predictions, labels
                                                                  #   (predict_with_generate: generate()'s ids)
                   on_prediction_step(run, step, total)
        compute_metrics; log_metrics(run, eval_metrics, step); on_evaluate(run, eval_metrics)

    predict(run, dataset, prefix)                 # Run.predict: as evaluate, but the metrics are
        on_predict(run, test_metrics)             #   returned, not logged (as Trainer.predict)

    save(run)
        on_eval_mode(run)
        checkpoint_state(run)                                     # each plugin its own
        write output_dir/checkpoint-<step>/ atomically
        on_checkpoint_saved(run, path)                            # the best model builtin rotates
                                                                  #   (save_total_limit)

Divergence: the losses and gradient norms stay tensors until the loop reads them anyway (a log
step, an evaluation, a save, the end); there they are checked, and a nan or inf stops the run
(``TrainingDiverged``) before anything non-finite is saved. ``train.on_nonfinite = "skip"``
instead skips such updates in the builtin step (one host sync per step).

Per-step work is kept to what a hand-written loop does: hook callers are looked up once, the
loss stays a tensor until a log step (no host sync per step), nothing is allocated per step
beyond the batches themselves.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from typing import Any

from . import checkpoint, rundir
from .errors import RestartTraining, TrainingDiverged, TrainingPreempted, TrialPruned
from .interval import Interval
from .loss import count_items
from .state import Control, RunView, TrainState

logger = logging.getLogger("engine")


def train(run: RunView) -> dict[str, float]:
    run.setup_strategy()  # the process group first: the main process decides the claim for all
    try:
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
    except TrialPruned:
        status = "pruned"
        raise
    except (KeyboardInterrupt, TrainingPreempted):
        status = "interrupted"
        raise
    finally:
        run.remove_patches()  # also when setup or the resume failed after patch_model
        claim.finish(status, run.isolated_hooks.failed)


def _train(run: RunView, claim: rundir.Claim) -> dict[str, float]:
    run.setup()
    hook, train_cfg, strategy = run.hook, run.config.train, run.strategy
    run.state.max_steps = run.num_training_steps
    if claim.resume_from is not None:
        run.hook.restore_checkpoint(run=run, path=claim.resume_from)
    claim.start(run)
    loop = _Loop(run, claim.resume_from)
    if strategy.is_main_process:
        run.isolated_hooks.call("log_hyperparams", params=run.config.to_mapping())
    status = "failed"
    try:
        hook.on_train_start(run=run)
        hook.on_train_mode(run=run)
        if train_cfg.eval_on_start:  # as Trainer: reported, but not a candidate for the best model
            hook.evaluate(run=run, dataset=None, prefix="eval", report=True, in_training=True)
            hook.on_train_mode(run=run)
        loop.train_until_done()
        summary = loop.summary()
        hook.on_eval_mode(run=run)
        hook.on_before_final_save(run=run)
        if train_cfg.save_final_model:
            checkpoint.save_final_model(run)
        hook.on_train_end(run=run)
        status = "success"
        return summary
    finally:
        hook.on_train_exit(run=run, status=status)
        run.remove_patches()
        if strategy.is_main_process:
            run.isolated_hooks.call("log_finish", status=status)
            run.isolated_hooks.report()
        strategy.teardown()


class _Loop:
    """The loop's own progress (no closures sharing rebound state): the logging interval, the step last
    saved, the learning rate last seen, and what the summary counts from."""

    def __init__(self, run: RunView, resume_from: Any):
        self.run, self.resume_from = run, resume_from
        self.state, self.control, self.strategy = run.state, run.control, run.strategy
        self.distributed = self.strategy.world_size > 1
        self.lr = float(run.optimizer.param_groups[0]["lr"])
        self.started = time.perf_counter()
        self.start_step, self.tokens_at_start = self.state.global_step, self.state.num_input_tokens_seen
        self._begin_attempt()

    def _begin_attempt(self) -> None:
        self.logged = Interval(self.run)
        self.saved_step = self.state.global_step if self.resume_from is not None else -1

    def train_until_done(self) -> None:
        """The epochs; again from the start when a training step asks for a restart."""
        while True:
            try:
                self._train_epochs()
                return
            except RestartTraining:
                _restart(self.run, self.resume_from)
                self._begin_attempt()

    def _train_epochs(self) -> None:
        run, state, control = self.run, self.state, self.control
        per_epoch = state.steps_per_epoch  # 0 for an IterableDataset: an epoch ends when it does
        first = state.global_step // per_epoch if per_epoch else 0
        for epoch in range(first, math.ceil(state.max_steps / per_epoch)) if per_epoch else itertools.count(first):
            if state.global_step >= state.max_steps:
                break
            done_in_epoch = self._start_epoch(epoch)
            run.hook.on_epoch_start(run=run)
            self._train_epoch(epoch, done_in_epoch)
            run.hook.on_epoch_end(run=run)
            self._act(epoch_end=True)
            if control.should_stop:
                break

    def _start_epoch(self, epoch: int) -> int:
        """Position the data at this epoch's first step not yet trained; returns how many were."""
        run, state, train_cfg = self.run, self.state, self.run.config.train
        per_epoch = state.steps_per_epoch
        # steps of this epoch trained before a resume: their batches are skipped, unless
        # ignore_data_skip (as Trainer: the resumed epoch's data from its start)
        done = state.global_step - epoch * per_epoch if per_epoch and not train_cfg.ignore_data_skip else 0
        sampler = run.train_loader.sampler
        if hasattr(sampler, "set_epoch"):
            rows_done = done * train_cfg.gradient_accumulation_steps * train_cfg.per_device_train_batch_size
            sampler.set_epoch(epoch, rows_done)
        run.train_loader.generator.manual_seed(train_cfg.seed + epoch)  # worker seeds per epoch
        state.epoch = float(epoch) + (done / per_epoch if per_epoch else 0.0)
        self.control.should_epoch_stop = False
        return done

    def _train_epoch(self, epoch: int, step_in_epoch: int) -> None:
        # hook callers and what a step reads, looked up once: the per-step cost is pluggy's dispatch only
        run, state, control, strategy, logged = self.run, self.state, self.control, self.strategy, self.logged
        training_step, on_step_end = run.hook.training_step, run.hook.on_step_end
        optimizer, scheduler_step = run.optimizer, run.scheduler.step
        accumulation, per_epoch = run.config.train.gradient_accumulation_steps, state.steps_per_epoch
        batches = iter(run.train_loader)
        while True:
            window = [strategy.to_device(b) for b in itertools.islice(batches, accumulation)]
            if not window:
                break
            num_items = self._count(window)
            self.lr = float(optimizer.param_groups[0]["lr"])  # a tensor for some optimizers (torchao)
            out = training_step(run=run, batches=window, num_items_in_batch=num_items)
            scheduler_step()
            state.global_step += 1
            step_in_epoch += 1
            state.epoch = epoch + (step_in_epoch / per_epoch if per_epoch else 0.0)
            logged.add(out)
            on_step_end(run=run)
            self._act()
            if control.should_stop or state.global_step >= state.max_steps or control.should_epoch_stop:
                break

    def _count(self, window: list[dict[str, Any]]) -> Any:
        """The window's input tokens into the interval; its label count (``num_items_in_batch``).

        A lone micro-batch's mean loss is already the window's mean: no count needed; with several
        processes, the count of the global batch (its losses then add up over processes to the global
        mean, whatever padding each process got).
        """
        logged = self.logged
        logged.tokens += sum(b["attention_mask"].sum() if logged.non_padding and "attention_mask" in b
                             else b["input_ids"].numel() for b in window if "input_ids" in b)
        if not ((len(window) > 1 or self.distributed) and "labels" in window[0]):
            return None
        num_items = sum(count_items(batch["labels"], self.run.label_shift) for batch in window)
        return self.strategy.reduce(num_items, "sum") if self.distributed else num_items

    def _act(self, epoch_end: bool = False) -> None:
        """What run.control asks after a step (or an epoch): log, evaluate, save, then abort."""
        control = self.control
        if control.should_log:
            if self.logged.count or not epoch_end:
                self._log()
            else:
                control.should_log = False  # nothing trained since the last log
        if control.should_evaluate:
            control.should_evaluate = False
            self._evaluate()
        if control.should_save:
            control.should_save = False
            self._save()
        if control.abort is not None:
            raise control.abort

    def _log(self) -> None:
        self.control.should_log = False
        metrics = self.logged.flush(self.lr)
        if self.strategy.is_main_process:
            self.run.isolated_hooks.call("log_metrics", metrics=metrics, step=self.state.global_step)
        if self.distributed:
            _share_requests(self.run)
        self.logged.stop_if_diverged()

    def _evaluate(self) -> None:
        run = self.run
        self.logged.stop_if_diverged()
        run.hook.evaluate(run=run, dataset=None, prefix="eval", report=True, in_training=True)
        if self.distributed:
            _share_requests(run)
        run.hook.on_train_mode(run=run)

    def _save(self) -> None:
        if self.saved_step != self.state.global_step:  # e.g. a save_steps save that is also an epoch's end
            self.logged.stop_if_diverged()
            checkpoint.save(self.run)
            self.saved_step = self.state.global_step
        self.run.hook.on_train_mode(run=self.run)

    def summary(self) -> dict[str, float]:
        """The end of training's figures, logged (and returned by Run.train)."""
        run, state, control, logged = self.run, self.state, self.control, self.logged
        if control.should_stop and state.global_step < state.max_steps:
            logger.info("stopped at step %d of %d: %s", state.global_step, state.max_steps,
                        control.stop_reason or "a plugin set run.control.should_stop")
        if logged.count and run.config.train.logging_strategy == "steps":
            self._log()  # the steps since the last log, when a plugin stopped the run
        logged.stop_if_diverged()
        logged.count_tokens()  # those not logged (logging_strategy "no" or "epoch")
        runtime = time.perf_counter() - self.started
        steps = state.global_step - self.start_step
        tokens = state.num_input_tokens_seen - self.tokens_at_start
        summary = {
            "train_runtime": round(runtime, 4),
            "train_steps_per_second": round(steps / runtime, 3) if runtime else 0.0,
            "train_tokens_per_second": round(tokens / runtime, 1) if runtime else 0.0,  # as include_tokens_per_second
            "train_loss": logged.mean_loss,
        }
        run.hook.on_train_summary(run=run, metrics=summary)
        if self.strategy.is_main_process:
            run.isolated_hooks.call("log_metrics", metrics=summary, step=state.global_step)
        return summary


def _restart(run: RunView, resume_from: Any) -> None:
    """Start training again from where it started (a training step raised RestartTraining): fresh progress
    and requests, a new loader, optimizer and scheduler, each plugin's own state back (on_restart), and
    the resumed checkpoint loaded again."""
    run.optimizer.zero_grad(set_to_none=True)
    run.optimizer = run.scheduler = None  # freed before the new ones are made
    _reset(run.state, TrainState())
    _reset(run.control, Control())
    run.prepare_training()
    run.state.max_steps = run.num_training_steps
    run.hook.on_restart(run=run)
    if resume_from is not None:
        run.hook.restore_checkpoint(run=run, path=resume_from)  # weights, optimizer, scheduler, RNG, progress, plugins


def _reset(record: object, fresh: object) -> None:
    """Set a record's fields to a fresh one's, in place (the loop and plugins hold the object)."""
    vars(record).update(vars(fresh))


def _share_requests(run: RunView) -> None:
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
