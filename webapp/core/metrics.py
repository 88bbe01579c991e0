"""Prometheus metrics for ``/metrics`` (text exposition format, ``prometheus_client``).

Most series are computed from the database (and the broker) at scrape time: they are then true for
every process of the deployment at once (workers, fleet hosts, several web servers) with no shared
state to keep. One series is measured where it happens: the live-event latency, observed by the web
server process that fans a task's events out to its viewers. With several server processes, set
``PROMETHEUS_MULTIPROC_DIR`` (an empty directory, cleared at start) and every process's observations
are summed by ``MultiProcessCollector``.

Series:
  flowstate_tasks{status,source}                        gauge: agent tasks by status
  flowstate_task_duration_seconds{status}               histogram: started -> finished, finished product tasks
  flowstate_event_delivery_latency_seconds              histogram: an agent step happened -> a server process
                                                        received it for its viewers
  flowstate_sandboxes{state,host}                       gauge: fleet sandbox records by state and host
  flowstate_admission_queue_length{host,purpose}        gauge: sandbox requests waiting on alive hosts
  flowstate_celery_queue_depth{queue}                   gauge: messages waiting in the broker queue
  flowstate_experiment_rollouts_per_second{experiment}  gauge: latest step of each running experiment
  flowstate_experiment_update_seconds{experiment}       gauge: its policy update time
  flowstate_semantic_index_builds{state}                gauge: snapshot index builds (queued, building, ready,
                                                        failed, cancelled, stalled), from their progress files
  flowstate_semantic_index_chunks{kind}                 gauge: chunks done / total of the builds queued or building
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

from prometheus_client import CollectorRegistry, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

logger = logging.getLogger(__name__)

DURATION_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

EVENT_LATENCY = Histogram(
    "flowstate_event_delivery_latency_seconds",
    "Time from an agent step (its event timestamp) to a web server process receiving it for live viewers.",
    buckets=LATENCY_BUCKETS,
)


def observe_live_message(message: dict) -> None:
    """Fan-out hook: record the latency of a live task-event message (its oldest event)."""
    ts = message.get("ts")
    if message.get("type") == "task.event" and isinstance(ts, int | float):
        EVENT_LATENCY.observe(max(0.0, time.time() - ts))


def _task_series():
    from django.db.models import Count, DurationField, ExpressionWrapper, F, Q, Sum

    from webapp.agents.models import AgentTask

    tasks = GaugeMetricFamily("flowstate_tasks", "Agent tasks by status.", labels=["status", "source"])
    counts = {(row["status"], row["source"]): row["n"]
              for row in AgentTask.objects.values("status", "source").annotate(n=Count("pk")).order_by()}
    for status in AgentTask.Status.values:
        for source in AgentTask.Source.values:
            tasks.add_metric([status, source], counts.get((status, source), 0))
    yield tasks

    duration = ExpressionWrapper(F("finished_at") - F("started_at"), output_field=DurationField())
    buckets = {f"le{i}": Count("pk", filter=Q(duration__lte=timedelta(seconds=bound)))
               for i, bound in enumerate(DURATION_BUCKETS)}
    rows = (AgentTask.objects.filter(source=AgentTask.Source.PRODUCT, started_at__isnull=False,
                                     finished_at__isnull=False)
            .annotate(duration=duration).values("status")
            .annotate(total=Count("pk"), seconds=Sum("duration"), **buckets).order_by())
    histogram = HistogramMetricFamily("flowstate_task_duration_seconds",
                                      "Finished product tasks: time from start to finish.", labels=["status"])
    for row in rows:
        cumulative = [(str(float(bound)), row[f"le{i}"]) for i, bound in enumerate(DURATION_BUCKETS)]
        seconds = row["seconds"].total_seconds() if row["seconds"] else 0.0
        histogram.add_metric([row["status"]], [*cumulative, ("+Inf", row["total"])], seconds)
    yield histogram


def _fleet_series():
    from django.db.models import Count

    from webapp.fleet.models import SandboxHost, SandboxRecord

    sandboxes = GaugeMetricFamily("flowstate_sandboxes", "Fleet sandboxes by state and host.", labels=["state", "host"])
    for row in SandboxRecord.objects.values("state", "host__name").annotate(n=Count("pk")).order_by():
        sandboxes.add_metric([row["state"], row["host__name"] or ""], row["n"])
    yield sandboxes
    queue = GaugeMetricFamily("flowstate_admission_queue_length",
                              "Sandbox requests waiting for admission, per alive host.", labels=["host", "purpose"])
    for host in SandboxHost.objects.filter(state=SandboxHost.State.ALIVE):
        queue.add_metric([host.name, "product"], host.queue_product)
        queue.add_metric([host.name, "training"], host.queue_training)
    yield queue


def _celery_series():
    from django.conf import settings
    from kombu.exceptions import ChannelError

    from webapp.celery import app

    depth = GaugeMetricFamily("flowstate_celery_queue_depth", "Messages waiting in the Celery broker queue.",
                              labels=["queue"])
    try:
        with app.connection_for_read() as connection:
            for name in settings.FLOWSTATE_CELERY_QUEUES:  # agents, experiments, maintenance (docs/DEPLOY.md)
                try:
                    _, count, _ = connection.default_channel.queue_declare(queue=name, passive=True)
                except ChannelError:  # never declared on this broker yet: nothing waits in it
                    count = 0
                depth.add_metric([name], count)
    except Exception:  # the broker down must not break the other series; the gap is visible
        logger.warning("celery queue depth unavailable", exc_info=True)
    yield depth


def _experiment_series():
    from webapp.experiments.models import Experiment, ExperimentStep

    rate = GaugeMetricFamily("flowstate_experiment_rollouts_per_second",
                             "Rollouts per second of each running experiment's latest step.", labels=["experiment"])
    update = GaugeMetricFamily("flowstate_experiment_update_seconds",
                               "Policy update time of each running experiment's latest step.", labels=["experiment"])
    for experiment in Experiment.objects.filter(status=Experiment.Status.RUNNING).only("pk"):
        latest = ExperimentStep.objects.filter(experiment=experiment).order_by("-step").first()
        if latest is None:
            continue
        label = [str(experiment.pk)]
        if isinstance(latest.metrics.get("rollouts_per_s"), int | float):
            rate.add_metric(label, latest.metrics["rollouts_per_s"])
        update_s = (latest.metrics.get("stage_seconds") or {}).get("update")
        if isinstance(update_s, int | float):
            update.add_metric(label, update_s)
    yield rate
    yield update


def _semantic_series():
    from sandboxes.semantic.progress import STATES, semantic_index_metrics

    builds = GaugeMetricFamily("flowstate_semantic_index_builds",
                               "Semantic index builds of snapshots, by state (progress files).", labels=["state"])
    chunks = GaugeMetricFamily("flowstate_semantic_index_chunks",
                               "Chunks encoded (done) and to encode (total) by the builds in progress.", labels=["kind"])
    try:
        summary = semantic_index_metrics()
    except Exception:  # an unreadable index root must not break the other series
        logger.warning("semantic index progress unavailable", exc_info=True)
        return
    for state in STATES:
        builds.add_metric([state], summary[f"builds_{state}"])
    chunks.add_metric(["done"], summary["building_chunks_done"])
    chunks.add_metric(["total"], summary["building_chunks_total"])
    yield builds
    yield chunks


class DatabaseCollector:
    """Series computed from the database and the broker when scraped."""

    def collect(self):
        yield from _task_series()
        yield from _fleet_series()
        yield from _celery_series()
        yield from _experiment_series()
        yield from _semantic_series()


def metrics_text() -> bytes:
    """The whole exposition: scrape-time series plus this process's (or all processes') histograms."""
    registry = CollectorRegistry()
    registry.register(DatabaseCollector())
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.MultiProcessCollector(registry)
    else:
        registry.register(EVENT_LATENCY)
    return generate_latest(registry)
