from celery import shared_task

from webapp.core.services import worker_probe_record


@shared_task(name="core.worker_probe")
def worker_probe(nonce: str, user_id: int | None = None) -> int:
    return worker_probe_record(nonce=nonce, user_id=user_id).pk
