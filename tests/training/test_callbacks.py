"""A user's own callback (vitflow.training.Callback): it sees every step, evaluation, checkpoint and
record of a run, can stop it, and keeps state across a kill and resume like the built-in ones."""

from __future__ import annotations

from helpers import digits_config
from vitflow import checkpoint as ckpt
from vitflow.rundir import read_metrics
from vitflow.training import Callback, Trainer

RUN = ("train.batch_size=32", "optim.warmup_steps=2", "train.total_steps=40", "train.eval_every=4",
       "train.checkpoint_every=4", "train.tensorboard=false", "train.live_report=false",
       "data.evals=minival:train[70%:80%]")


class Watcher(Callback):
    """Records what it is shown; stops the run at its ``stop_after``-th evaluation of the monitored split."""

    state_key = "watcher"

    def __init__(self, stop_after: int | None = None):
        self.stop_after, self.steps, self.evaluations, self.checkpoints, self.kinds = stop_after, [], [], [], set()
        self.started = self.ended = 0
        self.summary = None

    def on_fit_start(self, trainer):
        self.started += 1

    def on_step_end(self, trainer, out):
        self.steps.append(out.step)

    def on_evaluation(self, trainer, split, metrics):
        self.evaluations.append((trainer.step, split, metrics["top1"], trainer.finishing))
        monitored = [e for e in self.evaluations if e[1] == trainer.evaluator.monitored and not e[3]]
        if self.stop_after and len(monitored) == self.stop_after and not trainer.finishing:
            trainer.request_stop(f"watcher: {len(monitored)} evaluations are enough")

    def on_checkpoint(self, trainer, path):
        self.checkpoints.append((trainer.step, path.name))

    def on_record(self, trainer, record):
        self.kinds.add(record["kind"])

    def on_fit_end(self, trainer, summary):
        self.ended, self.summary = self.ended + 1, summary

    def state_dict(self):
        return {"steps_seen": len(self.steps)}

    def load_state_dict(self, state):
        self.steps = list(range(1, state["steps_seen"] + 1))


def test_a_user_callback_sees_every_evaluation_and_stops_the_run(tmp_path):
    run = tmp_path / "run"
    watcher = Watcher(stop_after=3)
    summary = Trainer(digits_config(run, *RUN), [watcher]).fit()
    # it stopped after the 3rd evaluation during training (step 12): the final evaluation is that one's
    assert summary["step"] == 12 and summary["stopped"] == "watcher: 3 evaluations are enough"
    assert watcher.steps == list(range(1, 13)) and (watcher.started, watcher.ended) == (1, 1)
    assert watcher.summary is summary
    evals = [r for r in read_metrics(run) if r["kind"] == "eval"]
    seen = [(step, split, round(top1, 6)) for step, split, top1, _ in watcher.evaluations]  # records keep 6 digits
    assert seen == [(r["step"], r["split"], r["top1"]) for r in evals]  # every evaluation, each split, in order
    assert {s for _, s, _ in seen} == {"test", "minival"} and len(seen) == 6
    assert watcher.checkpoints == [(4, "step-00000004.pt"), (8, "step-00000008.pt"), (12, "step-00000012.pt")]
    assert {"start", "train", "eval", "summary"} <= watcher.kinds
    assert ckpt.load_checkpoint(run)["watcher"] == {"steps_seen": 12}  # its state travels in the checkpoint


def test_a_user_callbacks_state_returns_on_resume(tmp_path):
    run = tmp_path / "run"
    Trainer(digits_config(run, *RUN, "train.total_steps=8"), [Watcher()]).fit()
    resumed = Watcher()
    summary = Trainer(digits_config(run, *RUN, "train.total_steps=12", "train.resume=auto"), [resumed]).fit()
    assert summary["step"] == 12 and "stopped" not in summary
    assert resumed.steps == list(range(1, 13))  # 8 restored from the checkpoint, then steps 9..12


def test_the_live_report_takes_at_most_its_share_of_the_run():
    """LiveReport rewrites the page after an evaluation only once 1/share times the last write's
    duration has passed; the first records always get a page, and an interrupted run's last
    evaluation is written at its end (a finished run's end is the caller's to write)."""
    from types import SimpleNamespace

    from vitflow.training.callbacks import LiveReport

    now, writes = [0.0], []

    def hook(run_dir):  # one write costs 1 s of the fake clock
        writes.append(now[0])
        now[0] += 1.0

    report = LiveReport(hook, share=0.05, clock=lambda: now[0])
    trainer = SimpleNamespace(dist=SimpleNamespace(is_main=True), evaluator=SimpleNamespace(named={"minival": 0}),
                              run_dir="run", step=0)

    def evaluation_at(t, split="val"):
        now[0] = t
        report.on_evaluation(trainer, split, {})

    report.on_record(trainer, {"kind": "train"})  # t=0: the pending page; next write due at 1 + 20
    evaluation_at(5)
    evaluation_at(15)
    evaluation_at(21.5)  # due: written, next due at 22.5 + 20
    evaluation_at(30, "minival")  # a named split's figures are part of the same round: not a write
    evaluation_at(40)
    assert writes == [0.0, 21.5]
    report.on_fit_end(trainer, {"step": 9})  # finished: the CLI / API write the final report
    assert writes == [0.0, 21.5]
    report.on_fit_end(trainer, {"interrupted": "SIGTERM"})  # the evaluation at t=40 reaches the page
    assert writes == [0.0, 21.5, 40.0]
    report.on_fit_end(trainer, {"interrupted": "SIGTERM"})
    assert len(writes) == 3  # nothing stale: nothing written again
