"""A new user watches a scripted task live in Chromium (1440x900), scrolling like a person: the view
follows the newest event while they are at the end, offers "jump to latest" when they scroll up, every
turn that comes into view shows its body at once, the tool cards seen live equal those after a reload,
the controls follow the status, the edit diff is numbered at the file's lines, and nothing logs an error."""

from __future__ import annotations

import pytest

from tests.browser import chromium_page, console_error, login, submit_scripted_task

pytestmark = pytest.mark.browser

# Turns on screen whose body is still empty although they have events to show: the bare turns of the issue.
BARE_VISIBLE_TURNS = """() => {
    const shown = new Set(['start', 'user_message', 'model_output', 'tool_call', 'final', 'tests']);
    const bare = [];
    for (const turn of flowstateTrace.sections) {
        const rect = turn.section.getBoundingClientRect();
        if (rect.bottom < 0 || rect.top > innerHeight) continue;
        const visible = turn.events.some((e) => shown.has(e.kind) && (e.kind !== 'model_output' || e.payload.content));
        if (visible && !turn.body.children.length) bare.push(turn.key);
    }
    return bare;
}"""

# data-call ids of the tool cards inside the viewport.
CARDS_IN_VIEW = """() => [...document.querySelectorAll('.ev-tool[data-call]')]
    .filter((card) => { const r = card.getBoundingClientRect(); return r.bottom > 0 && r.top < innerHeight; })
    .map((card) => card.dataset.call + '@' + card.closest('section.turn').dataset.turn)"""

LAST_EVENT_IN_VIEW = """() => {
    const nodes = document.querySelectorAll('[data-role=timeline] .ev');
    if (!nodes.length) return false;
    const rect = nodes[nodes.length - 1].getBoundingClientRect();
    return rect.top < innerHeight && rect.bottom > 0;
}"""


def _scroll_through(page, bare: list) -> set[str]:
    """Scroll from the top to the end with the mouse wheel, a screen at a time, as a reader does; the
    tool cards seen on the way (each turn's body must be there the moment it is on screen)."""
    page.mouse.move(700, 450)
    page.evaluate("window.scrollTo(0, 0)")
    page.wait_for_timeout(50)
    seen: set[str] = set()
    for _ in range(200):
        page.wait_for_timeout(60)  # a few frames: what the reader sees once the wheel stops
        bare.extend(page.evaluate(BARE_VISIBLE_TURNS))
        seen.update(page.evaluate(CARDS_IN_VIEW))
        if page.evaluate("innerHeight + scrollY >= document.documentElement.scrollHeight - 2"):
            break
        page.mouse.wheel(0, 600)
    return seen


def _watch_live(page, bare: list) -> None:
    """While the run is live: it follows the newest event; scrolled up it stops and offers the jump."""
    for count in (3, 5, 7):
        page.wait_for_function(f"() => document.querySelectorAll('.ev-tool').length >= {count} || "
                               "flowstateTrace.status !== 'running'", timeout=60_000)
        if page.evaluate("flowstateTrace.status") != "running":
            break
        page.wait_for_function(LAST_EVENT_IN_VIEW, timeout=2_000)  # followed, without the user scrolling
        assert page.evaluate("flowstateTrace.following")
        assert page.locator("[data-role=create-branch]").is_hidden(), "create branch offered while running"
        assert page.locator("[data-role=cancel]").is_visible()
    if page.evaluate("flowstateTrace.status") == "running" and page.evaluate("scrollY") > 300:
        page.mouse.move(700, 450)
        page.mouse.wheel(0, -500)
        page.wait_for_timeout(150)
        bare.extend(page.evaluate(BARE_VISIBLE_TURNS))
        assert not page.evaluate("flowstateTrace.following"), "still following after the user scrolled up"
        if page.evaluate("flowstateTrace.status") == "running" and not page.evaluate("flowstateTrace.endInView()"):
            page.locator("[data-role=jump-latest]").wait_for(state="visible", timeout=2_000)
            page.click("[data-role=jump-latest]")
            page.wait_for_function(LAST_EVENT_IN_VIEW, timeout=2_000)
            assert page.evaluate("flowstateTrace.following")


def _edit_diff_numbers(page) -> tuple[list[str], bool]:
    """The edit card's old-side line numbers, and whether any old and new number boxes overlap."""
    return page.evaluate("""() => {
        const card = document.querySelector('.tool-edit_file');
        const nums = [...card.querySelectorAll('.d2h-code-linenumber')];
        const overlap = nums.some((cell) => {
            const a = cell.querySelector('.line-num1'), b = cell.querySelector('.line-num2');
            if (!a || !b || !a.textContent.trim() || !b.textContent.trim()) return false;
            const ra = a.getBoundingClientRect(), rb = b.getBoundingClientRect();
            return ra.right > rb.left + 0.5 && ra.left < rb.right - 0.5 && ra.bottom > rb.top && ra.top < rb.bottom;
        });
        return [nums.map((cell) => (cell.querySelector('.line-num1') || {}).textContent || '').map((t) => t.trim()).filter(Boolean), overlap];
    }""")


@pytest.mark.django_db(transaction=True)
def test_watch_live_scrolling_like_a_person(owner, demo_repository, asgi_server, celery_worker_process):
    from training.agent import demo_repo

    buggy_line = next(n for n, line in enumerate(demo_repo.DEMO_FILES["stats/summary.py"].splitlines(), 1)
                      if line == demo_repo._BUGGY_LINE.splitlines()[0])
    base = f"http://{asgi_server}"
    errors: list[str] = []
    bare: list = []
    with chromium_page("agents_live_walk") as page:
        page.set_viewport_size({"width": 1440, "height": 900})
        page.set_default_timeout(120_000)  # the server shares its machine with the sandboxes and the worker
        page.on("console", lambda message: console_error(errors, message))
        page.on("pageerror", lambda error: errors.append(str(error)))
        login(page, base, "owner", "owner-pass-123")
        task_id = submit_scripted_task(page, base, demo_repository.pk, step_delay_s=0.6)

        page.wait_for_function("() => window.flowstateTrace && flowstateTrace.status === 'running'", timeout=60_000)
        _watch_live(page, bare)
        page.wait_for_function("() => flowstateTrace.status === 'succeeded' && flowstateTrace.outcome === 'tests_pass'",
                               timeout=120_000)
        live_cards = _scroll_through(page, bare)
        calls = page.evaluate("flowstateTrace.events.filter((e) => e.kind === 'tool_call').length")

        # After the finish: the status, the controls and the notes say so.
        assert page.locator("[data-role=status]").inner_text() == "finished, tests pass"
        assert page.locator("[data-role=cancel]").is_hidden(), "Cancel offered on a finished task"
        assert page.locator("[data-role=create-branch]").is_visible()
        assert "running" not in page.locator("[data-role=reason]").inner_text()
        assert f"Task {task_id} queued." not in page.locator("main").inner_text()
        numbers, overlap = _edit_diff_numbers(page)
        assert numbers and numbers[0] == str(buggy_line), (numbers, buggy_line)
        assert not overlap, "old and new line numbers overlap"
        final_overlap = page.evaluate("""() => [...document.querySelectorAll('[data-role=final] .d2h-code-linenumber')].some((cell) => {
            const a = cell.querySelector('.line-num1'), b = cell.querySelector('.line-num2');
            if (!a || !b || !a.textContent.trim() || !b.textContent.trim()) return false;
            const ra = a.getBoundingClientRect(), rb = b.getBoundingClientRect();
            return ra.right > rb.left + 0.5 && ra.bottom > rb.top && ra.top < rb.bottom; })""")
        assert not final_overlap, "the result diff's old and new line numbers overlap"

        page.reload()
        page.wait_for_function("() => window.flowstateTrace && flowstateTrace.events.length > 30 && "
                               "flowstateTrace.status === 'succeeded'", timeout=30_000)
        reloaded_cards = _scroll_through(page, bare)
    assert len(reloaded_cards) == calls == 10
    assert live_cards == reloaded_cards, (sorted(live_cards), sorted(reloaded_cards))
    assert bare == [], f"turns on screen without their body: {bare[:10]}"
    assert errors == [], errors
