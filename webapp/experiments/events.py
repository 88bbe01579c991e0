"""An experiment's live messages: published after commit to its group (``webapp.core.publish``)."""

from __future__ import annotations

from webapp.core.publish import publish_on_commit
from webapp.experiments.models import Experiment
from webapp.experiments.selectors import experiment_group_name


def experiment_publish(experiment: Experiment, message: dict) -> None:
    """Send ``message`` to the experiment's dashboards once the transaction commits.

    A viewer that misses one reloads from the snapshot the consumer sends on connect. A message that
    ends the run waits up to 2 s to leave, so a process exiting right after still sends it.
    """
    wait_s = 2.0 if message.get("kind") == "status" and message.get("status") not in Experiment.ACTIVE else 0.0
    publish_on_commit(group=experiment_group_name(experiment_id=experiment.pk),
                      message={"type": "experiment.update", "message": message}, wait_s=wait_s)


def experiment_status_message(experiment: Experiment) -> dict:
    return {
        "kind": "status",
        "status": experiment.status,
        "reason": experiment.status_reason,
        "current_step": experiment.current_step,
        "total_steps": experiment.total_steps,
    }
