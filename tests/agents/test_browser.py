"""Chromium watches a live run: steps appear while it runs, a dropped connection resumes without
gaps or duplicates, the diff renders, the patch downloads and the trace browser finds the task."""

from __future__ import annotations

import pytest

from tests.browser import chromium_page, login, submit_scripted_task

pytestmark = pytest.mark.browser


@pytest.mark.django_db(transaction=True)
def test_watch_live_run_reconnect_and_find_it_again(owner, demo_repository, asgi_server, celery_worker_process):
    base = f"http://{asgi_server}"
    with chromium_page("agents_live_run") as page:
        login(page, base, "owner", "owner-pass-123")
        task_id = submit_scripted_task(page, base, demo_repository.pk, step_delay_s=0.6)

        # Steps show up while the agent is still running.
        page.wait_for_function("() => window.flowstateTrace && flowstateTrace.status === 'running' && "
                               "document.querySelectorAll('.ev-tool').length >= 2", timeout=60_000)
        assert page.locator("[data-role=progress]").is_visible()
        assert page.locator(".call-group.parallel .group-label").first.inner_text() == "3 parallel calls"

        # Drop the socket mid-run; the view reconnects from its cursor.
        seen_before = page.evaluate("flowstateTrace.lastSeq")
        page.evaluate("flowstateTrace.dropConnection()")
        page.wait_for_function("() => flowstateTrace.reconnects >= 1 && flowstateTrace.root.dataset.connection === 'live'",
                               timeout=15_000)
        page.wait_for_function("() => flowstateTrace.status === 'succeeded'", timeout=90_000)
        seqs = page.evaluate("flowstateTrace.events.map(e => e.seq)")
        assert seqs == list(range(len(seqs))) and seqs[-1] > seen_before
        assert page.locator("[data-role=final] .d2h-wrapper").count() == 1
        assert "ordered[middle - 1]" in page.locator("[data-role=final]").inner_text()
        assert page.locator("pre.terminal").first.is_visible()
        assert "exit code 1" in page.locator(".tool-run_terminal").first.inner_text()
        assert page.locator("[data-role=todos] li.completed").count() == 3
        assert not page.locator("[data-role=progress]").is_visible()

        with page.expect_download() as download:
            page.click("[data-role=patch]")
        assert download.value.suggested_filename == f"flowstate-task-{task_id}.patch"

        page.goto(f"{base}/tasks/traces/?q=median&status=succeeded")
        assert page.locator(f"tr[data-task='{task_id}']").count() == 1


def _long_trace_result(n_turns: int):
    """A recorded run of ``4 * n_turns + 2`` events in the loop's event format."""
    from training.agent.loop import AgentResult

    events, seq = [], 0

    def add(kind, turn, payload):
        nonlocal seq
        events.append({"seq": seq, "kind": kind, "turn": turn, "ts": 1_700_000_000 + seq * 0.01, "payload": payload})
        seq += 1

    add("start", 0, {"prompt": "Long run", "policy": "recorded", "limits": {}, "tools": []})
    for turn in range(1, n_turns + 1):
        add("turn_start", turn, {"context_tokens": 100})
        add("model_output", turn, {"content": f"step {turn}", "tool_calls": 1, "prompt_tokens": 100, "completion_tokens": 10,
                                   "tokens_estimated": False, "finish_reason": "tool_calls", "duration_s": 0.1})
        add("tool_call", turn, {"call_id": f"c{turn}", "name": "run_terminal", "arguments": {"command": f"echo {turn}"},
                                "index": 0, "count": 1})
        add("tool_result", turn, {"call_id": f"c{turn}", "name": "run_terminal", "ok": True, "output": f"{turn}\n",
                                  "display": f"{turn}\n", "duration_s": 0.01, "meta": {"exit_code": 0}, "finished_at": 0})
    add("final", n_turns, {"status": "succeeded", "reason": "done", "content": "All done.", "diff": "", "prompt_tokens": 0,
                           "completion_tokens": 0, "turns": n_turns, "summaries": 0, "duration_s": 1, "infrastructure": False})
    return AgentResult(status="succeeded", reason="done", final_message="All done.", diff="", turns=n_turns,
                       prompt_tokens=100 * n_turns, completion_tokens=10 * n_turns, duration_s=1.0,
                       messages=[], events=events)


@pytest.mark.django_db(transaction=True)
def test_a_5000_event_trace_renders_lazily(owner, asgi_server):
    from webapp.agents.services import rollout_record

    task = rollout_record(owner=owner, result=_long_trace_result(1250), prompt="Long run", experiment_name="render",
                          repo_label="long", model_name="recorded")
    assert task.events.count() == 5002
    base = f"http://{asgi_server}"
    with chromium_page("agents_long_trace") as page:
        login(page, base, "owner", "owner-pass-123")
        page.goto(f"{base}/tasks/{task.pk}/")
        page.wait_for_function("() => window.flowstateTrace && flowstateTrace.events.length === 5002", timeout=60_000)
        # Only turns near the viewport are rendered; every turn has its header.
        assert page.locator("section.turn").count() == 1252
        rendered = page.locator(".ev-tool").count()
        assert 0 < rendered < 200, rendered
        assert "1250 turns" in page.locator("[data-role=counters]").inner_text()
        page.locator("section.turn").last.scroll_into_view_if_needed()
        page.wait_for_function("() => document.querySelector('[data-role=final]').innerText.includes('All done.')")
        page.locator("section.turn[data-turn='1250']").scroll_into_view_if_needed()
        page.wait_for_function("() => document.querySelector(\"section.turn[data-turn='1250'] .ev-tool\") !== null")
