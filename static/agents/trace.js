/* Flowstate trace view: renders the events of one agent run, live over a resumable websocket or
 * from the REST API. A turn's body is built when its section comes within MARGIN px of the viewport (in
 * the frame of the scroll or event that brought it there), so 5,000 events stay fast. While the run is
 * live and the end of the timeline is in view, the view follows the newest event like a terminal;
 * scrolled up, it offers "jump to latest". Event format: see training/agent/loop.py. */
(function () {
  "use strict";

  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "text") node.textContent = value;
      else if (key === "cls") node.className = value;
      else node.setAttribute(key, value);
    }
    for (const child of children || []) if (child) node.appendChild(child);
    return node;
  }

  const MARGIN = 600;  // px beyond the viewport whose turns are built ahead of the scroll
  const FOLLOW_SLACK = 80;  // px: the end of the timeline this close to the viewport's bottom counts as "at the end"
  const LIVE = ["queued", "running", "verifying"];
  const OUTCOMES = { tests_pass: "tests pass", tests_fail: "tests fail", no_tests: "no tests", error: "tests could not run" };
  // The loop stopping on its own is not success: the verification below says whether the tests pass.
  function finalLabel(status) { return status === "succeeded" ? "agent finished" : status; }
  function fmtTokens(n) { return n >= 10000 ? (n / 1000).toFixed(1) + "k" : String(n); }
  function fmtSeconds(s) { return s >= 60 ? Math.floor(s / 60) + "m" + String(Math.round(s % 60)).padStart(2, "0") + "s" : s.toFixed(1) + "s"; }

  function diffLines(text, sign) {
    if (!text) return [];
    return text.replace(/\n$/, "").split("\n").map((l) => sign + l);
  }

  // A one-hunk diff of an edit whose first line is ``line`` in the file (the tool reports it once the edit
  // ran; before that it is unknown and the hunk starts at 1). Unified-diff convention: an empty side
  // starts at the line before.
  function simpleDiff(path, oldText, newText, line) {
    const at = line || 1;
    const minus = diffLines(oldText, "-"), plus = diffLines(newText, "+");
    const side = (n) => `${n ? at : at - 1},${n}`;
    const body = minus.concat(plus).join("\n");
    return `--- a/${path}\n+++ b/${path}\n@@ -${side(minus.length)} +${side(plus.length)} @@\n${body}\n`;
  }

  function renderDiff(container, diffText) {
    if (!diffText) { container.appendChild(el("p", { cls: "muted", text: "No changes." })); return; }
    if (window.Diff2HtmlUI) {
      const target = el("div", { cls: "diff" });
      container.appendChild(target);
      new window.Diff2HtmlUI(target, diffText, { drawFileList: false, matching: "lines", outputFormat: "line-by-line", highlight: false, colorScheme: "dark" }).draw();
    } else {
      container.appendChild(el("pre", { cls: "diff-raw", text: diffText }));
    }
  }

  class TraceView {
    constructor(root, options) {
      this.root = root;
      this.taskId = options.taskId;
      this.apiBase = `/api/tasks/${this.taskId}`;
      this.events = [];
      this.lastSeq = -1;
      this.turns = new Map();
      this.sections = [];  // turns in timeline order (their sections' tops only grow along it)
      this.segment = 0;  // user turns after the first prompt: each follow-up starts a new segment
      this.calls = new Map();
      this.status = options.status || "queued";
      this.outcome = options.outcome || "";
      this.startedTs = null;
      this.lastTs = null;
      this.totals = { prompt: 0, completion: 0, calls: 0, turns: 0 };
      this.reconnects = 0;
      this.socket = null;
      this.closedByUs = false;
      this.timeline = root.querySelector("[data-role=timeline]");
      this.counters = root.querySelector("[data-role=counters]");
      this.todoPanel = root.querySelector("[data-role=todos]");
      this.finalPanel = root.querySelector("[data-role=final]");
      this.statusBadge = root.querySelector("[data-role=status]");
      this.connection = root.querySelector("[data-role=connection]");
      this.progress = root.querySelector("[data-role=progress]");
      this.reasonLine = root.querySelector("[data-role=reason]");
      // Events replayed from the backlog describe the past: until the server's status message, they
      // do not change the status the page was rendered with.
      this.replaying = true;
      this.following = LIVE.includes(this.status);
      this.lastScrollY = window.scrollY;
      this.framePending = false;
      this.jump = el("button", { type: "button", cls: "jump-latest", "data-role": "jump-latest", text: "Jump to latest ↓", hidden: "" });
      this.jump.addEventListener("click", () => { this.following = true; this.frame(); });
      root.appendChild(this.jump);
      window.addEventListener("scroll", () => this.onScroll(), { passive: true });
      window.addEventListener("resize", () => this.scheduleFrame());
      this.setStatus(this.status, options.reason || "");
      setInterval(() => this.renderCounters(), 1000);
    }

    // --- data ---
    add(event) {
      if (event.seq <= this.lastSeq) return;  // duplicate: already shown
      this.lastSeq = event.seq;
      this.events.push(event);
      if (this.startedTs === null) this.startedTs = event.ts;
      this.lastTs = event.ts;
      const p = event.payload || {};
      if (event.kind === "model_output") { this.totals.prompt += p.prompt_tokens || 0; this.totals.completion += p.completion_tokens || 0; }
      if (event.kind === "summary") { this.totals.prompt += p.prompt_tokens || 0; this.totals.completion += p.completion_tokens || 0; }
      if (event.kind === "tool_call") this.totals.calls += 1;
      if (event.kind === "turn_start") this.totals.turns = Math.max(this.totals.turns, event.turn);
      if (event.kind === "tool_call" && p.name === "todo_write" && p.arguments && Array.isArray(p.arguments.todos)) this.renderTodos(p.arguments.todos);
      if (event.kind === "user_message") this.startSegment(event);
      if (event.kind === "final") this.renderFinal(event);
      if (event.kind === "tests") this.renderTests(event);
      const turn = this.turnFor(event);
      turn.events.push(event);
      this.updateTurnHeader(turn);
      if (turn.rendered) this.renderEvent(turn, event);
      this.scheduleFrame();
    }

    // Section keys: "start", "user-<seq>" (a follow-up), "<turn>", "result-<segment>" (final + tests of each run).
    turnFor(event) {
      let key = String(event.turn);
      if (event.kind === "start") key = "start";
      else if (event.kind === "user_message") key = `user-${event.seq}`;
      else if (event.kind === "final" || event.kind === "tests") key = `result-${this.segment}`;
      let turn = this.turns.get(key);
      if (!turn) {
        const section = el("section", { cls: "turn" + (key.startsWith("user-") ? " turn-user" : ""), "data-turn": key });
        const header = el("header", { cls: "turn-header" });
        const body = el("div", { cls: "turn-body" });
        section.append(header, body);
        this.timeline.appendChild(section);
        turn = { key, section, header, body, events: [], rendered: false, group: null };
        this.turns.set(key, turn);
        this.sections.push(turn);
      }
      return turn;
    }

    updateTurnHeader(turn) {
      let label;
      if (turn.key === "start") label = "Task";
      else if (turn.key.startsWith("user-")) {
        const p = turn.events[0].payload || {};
        label = `Follow-up${p.author ? " from " + p.author : ""}${p.workspace ? " · " + p.workspace + " workspace" : ""}`;
      } else if (turn.key.startsWith("result-")) label = turn.key === "result-0" ? "Result" : `Result after follow-up ${turn.key.slice(7)}`;
      else {
        const out = turn.events.find((e) => e.kind === "model_output");
        const calls = turn.events.filter((e) => e.kind === "tool_call").length;
        const parts = [`Turn ${turn.key}`];
        if (out) parts.push(`${fmtTokens(out.payload.prompt_tokens)} prompt · ${fmtTokens(out.payload.completion_tokens)} completion tokens`);
        if (calls) parts.push(`${calls} tool call${calls > 1 ? "s" : ""}${calls > 1 ? " in parallel" : ""}`);
        if (turn.events.some((e) => e.kind === "summary")) parts.push("context summarised");
        label = parts.join(" · ");
      }
      turn.header.textContent = label;
    }

    renderTurnBody(key) {
      const turn = this.turns.get(key);
      if (!turn || turn.rendered) return;
      turn.rendered = true;
      for (const event of turn.events) this.renderEvent(turn, event);
    }

    // --- viewport: build what is in view, follow the newest event ---
    scheduleFrame() {
      if (this.framePending) return;
      this.framePending = true;
      requestAnimationFrame(() => { this.framePending = false; this.frame(); });
    }

    frame() {
      if (this.following) this.stick();
      this.renderVisible();
      if (this.following) this.stick();  // the bodies just built may have pushed the end down again
      this.updateJump();
    }

    onScroll() {
      // Scrolling up away from the end stops following; reaching the end again resumes it. Growth of
      // the page (new events, bodies built above) never scrolls up, so it cannot stop following.
      const y = window.scrollY;
      if (y < this.lastScrollY - 2 && !this.endInView()) this.following = false;
      else if (this.endInView() && LIVE.includes(this.status)) this.following = true;
      this.lastScrollY = y;
      this.frame();
    }

    timelineBottom() { return this.timeline.getBoundingClientRect().bottom; }

    endInView() { return this.timelineBottom() <= window.innerHeight + FOLLOW_SLACK; }

    // Scroll down until the end of the timeline is in view; never up (the user may be below it, typing).
    stick() {
      const below = this.timelineBottom() - window.innerHeight + 16;
      if (below > 0) { window.scrollBy(0, below); this.lastScrollY = window.scrollY; }
    }

    updateJump() {
      this.jump.hidden = this.following || !LIVE.includes(this.status) || this.endInView();
    }

    // Build every turn whose section lies within MARGIN px of the viewport; the first candidate is found
    // by binary search. One layout per call: bodies built here only grow sections the band already
    // holds (unbuilt ones are short, so the band over-covers), and a follow-up frame checks again.
    renderVisible() {
      const list = this.sections;
      if (!list.length) return;
      const top = -MARGIN, bottom = window.innerHeight + MARGIN;
      let lo = 0, hi = list.length - 1;
      while (lo < hi) {
        const mid = (lo + hi) >> 1;
        if (list[mid].section.getBoundingClientRect().bottom < top) lo = mid + 1; else hi = mid;
      }
      const due = [];
      for (let i = lo; i < list.length; i += 1) {
        if (list[i].section.getBoundingClientRect().top > bottom) break;
        if (!list[i].rendered) due.push(list[i]);
      }
      for (const turn of due) this.renderTurnBody(turn.key);
      if (due.length) this.scheduleFrame();
    }

    // --- rendering ---
    renderEvent(turn, event) {
      const p = event.payload || {};
      const body = turn.body;
      switch (event.kind) {
        case "start":
          body.appendChild(el("div", { cls: "ev ev-start" }, [el("div", { cls: "label", text: `Prompt · ${p.policy || ""}${p.sandbox_runtime ? ` · sandbox runtime ${p.sandbox_runtime}` : ""}` }), el("pre", { text: p.prompt })]));
          break;
        case "user_message":
          body.appendChild(el("div", { cls: "ev ev-user", "data-seq": String(event.seq) }, [el("pre", { cls: "user-text", text: p.content })]));
          break;
        case "turn_start":
          break;
        case "model_output":
          if (p.content) body.appendChild(el("div", { cls: "ev ev-model", "data-seq": String(event.seq) }, [el("div", { cls: "assistant", text: p.content })]));
          break;
        case "tool_call": {
          if (!turn.group || turn.groupSize !== p.count || turn.groupFilled >= p.count) {
            turn.group = el("div", { cls: "call-group" + (p.count > 1 ? " parallel" : "") });
            if (p.count > 1) turn.group.appendChild(el("div", { cls: "label group-label", text: `${p.count} parallel calls` }));
            turn.groupSize = p.count; turn.groupFilled = 0;
            body.appendChild(turn.group);
          }
          turn.groupFilled += 1;
          const card = el("div", { cls: `ev ev-tool tool-${p.name}`, "data-seq": String(event.seq), "data-call": p.call_id });
          card.appendChild(el("div", { cls: "tool-head" }, [el("span", { cls: "tool-name", text: p.name }), el("span", { cls: "muted spinner-small", text: " running…" })]));
          card.appendChild(this.renderArguments(p.name, p.arguments));
          turn.group.appendChild(card);
          card.toolArgs = p.arguments;
          this.calls.set(p.call_id + ":" + turn.key, card);
          break;
        }
        case "tool_result": {
          const card = this.calls.get(p.call_id + ":" + turn.key);
          const target = card || body.appendChild(el("div", { cls: "ev ev-tool" }));
          this.renderResult(target, event);
          break;
        }
        case "summary":
          body.appendChild(el("div", { cls: "ev ev-summary", "data-seq": String(event.seq) }, [
            el("div", { cls: "label", text: `Context summarised here (summary ${p.index}, context was ~${fmtTokens(p.context_tokens)} tokens)` }),
            el("pre", { text: p.summary })]));
          break;
        case "retry":
          body.appendChild(el("div", { cls: "ev ev-retry warn", text: `Retry: ${p.reason}` }));
          break;
        case "error":
          body.appendChild(el("div", { cls: "ev ev-error bad", text: `${p.infrastructure ? "Infrastructure error" : "Error"}: ${p.message}` }));
          break;
        case "final":
          body.appendChild(el("div", { cls: "ev ev-final" }, [el("div", { cls: `label ${p.status === "succeeded" ? "ok" : "bad"}`, text: `${finalLabel(p.status)}: ${p.reason}` }),
            p.content ? el("div", { cls: "assistant", text: p.content }) : null]));
          break;
        case "tests":
          body.appendChild(el("div", { cls: "ev ev-tests" }, [el("div", { cls: `label ${p.outcome === "tests_pass" ? "ok" : "bad"}`, text: `Tests: ${OUTCOMES[p.outcome] || p.outcome}: ${p.summary}` }),
            p.command ? el("pre", { cls: "args cmd", text: "$ " + p.command }) : null]));
          break;
        default:
          body.appendChild(el("pre", { cls: "ev", text: JSON.stringify(event) }));
      }
    }

    renderArguments(name, args) {
      if (typeof args === "string") return el("pre", { cls: "args bad", text: args });
      args = args || {};
      if (name === "run_terminal") return el("pre", { cls: "args cmd", text: "$ " + (args.command || "") });
      if (name === "edit_file") return this.editBox(args, 0);
      if (name === "replace_lines") {
        const where = `${args.path || ""} lines ${args.start_line ?? "?"}-${args.end_line ?? "?"}`;
        return el("div", { cls: "args" }, [el("div", { cls: "muted", text: where }), el("pre", { cls: "mono", text: args.new_text ?? "" })]);
      }
      if (name === "create_file") {
        const box = el("div", { cls: "args" });
        renderDiff(box, simpleDiff(args.path || "file", "", args.content || ""));
        return box;
      }
      if (name === "todo_write") return el("div", { cls: "args muted", text: `${(args.todos || []).length} todo items` });
      const summary = Object.entries(args).map(([k, v]) => `${k}: ${typeof v === "string" ? v : JSON.stringify(v)}`).join("\n");
      return el("pre", { cls: "args", text: summary });
    }

    editBox(args, line) {
      const where = line ? `${args.path || ""} from line ${line}` : args.path || "";
      const box = el("div", { cls: "args", "data-role": "edit-diff" }, [el("div", { cls: "muted", text: where })]);
      renderDiff(box, simpleDiff(args.path || "file", args.old_str ?? "", args.new_str ?? "", line));
      return box;
    }

    renderResult(card, event) {
      const p = event.payload || {};
      // The edit's line in the file is known once it ran: its diff is numbered from there.
      const edited = card.querySelector("[data-role=edit-diff]");
      if (edited && p.ok && p.meta && p.meta.line && card.toolArgs) edited.replaceWith(this.editBox(card.toolArgs, p.meta.line));
      const head = card.querySelector(".spinner-small");
      if (head) head.textContent = ` ${p.ok ? "ok" : "failed"} · ${fmtSeconds(p.duration_s || 0)}`;
      if (head) head.className = p.ok ? "ok" : "bad";
      const meta = p.meta || {};
      const output = el("div", { cls: "result", "data-seq": String(event.seq) });
      if (p.name === "run_terminal" && meta.exit_code !== undefined) {
        output.appendChild(el("div", { cls: meta.exit_code === 0 ? "ok" : "bad", text: `exit code ${meta.exit_code}${meta.timed_out ? " (timed out)" : ""}` }));
      }
      if ((p.name === "edit_file" || p.name === "create_file") && meta.diff) renderDiff(output, meta.diff);
      else if (p.name === "todo_write" && p.ok) output.appendChild(el("div", { cls: "muted", text: "todo list updated" }));
      else output.appendChild(el("pre", { cls: "mono" + (p.name === "run_terminal" ? " terminal" : ""), text: p.display || "" }));
      if (p.output_chars && p.output_chars > (p.display || "").length) {
        const link = el("a", { href: `${this.apiBase}/events/${event.seq}/output/`, target: "_blank", text: `full output (${p.output_chars} characters)` });
        output.appendChild(link);
      }
      card.appendChild(output);
    }

    renderTodos(todos) {
      if (!this.todoPanel) return;
      this.todoPanel.replaceChildren(...todos.map((t) => el("li", { cls: `todo ${t.status}`, text: `${t.status === "completed" ? "✔" : t.status === "in_progress" ? "▶" : "○"} ${t.content}` })));
    }

    startSegment(event) {
      this.segment += 1;
      // The previous result stays in the timeline; the panel below follows the newest run.
      if (this.finalPanel) this.finalPanel.replaceChildren(el("div", { cls: "muted", text: "The agent continues after your follow-up…" }));
      this.finalPanel && this.finalPanel.removeAttribute("hidden");
      if (!this.replaying && this.status !== "queued" && this.status !== "running") this.setStatus("running", "follow-up");
    }

    renderFinal(event) {
      if (!this.finalPanel) return;
      const p = event.payload;
      this.finalPanel.replaceChildren(
        el("h3", { text: "Result" }),
        el("div", { cls: p.status === "succeeded" ? "ok" : "bad", text: `${finalLabel(p.status)}: ${p.reason}` }),
        p.content ? el("div", { cls: "assistant final-message", text: p.content }) : el("span"),
      );
      const diffBox = el("div", { cls: "final-diff" });
      this.finalPanel.appendChild(diffBox);
      renderDiff(diffBox, p.diff);
      // A live task that stopped normally now runs its tests; the server's status message ends it.
      if (this.replaying) return;
      if (p.status === "succeeded" && this.status === "running") this.setStatus("verifying", "running the repository's tests");
      else this.setStatus(p.status, p.reason);
    }

    renderTests(event) {
      const p = event.payload || {};
      this.outcome = p.outcome || "";
      if (this.finalPanel) {
        const output = el("details", {}, [el("summary", { text: "test output" }), el("pre", { cls: "mono terminal", text: p.output || "" })]);
        this.finalPanel.appendChild(el("div", { cls: "tests-result", "data-role": "tests" }, [
          el("h3", { text: "Verification" }),
          el("div", { cls: p.outcome === "tests_pass" ? "ok" : "bad", text: `${OUTCOMES[p.outcome] || p.outcome}: ${p.summary}` }),
          p.command ? el("pre", { cls: "args cmd", text: "$ " + p.command }) : el("span"), output]));
      }
      this.setStatus(this.status, this.statusBadge ? this.statusBadge.title : "");
    }

    renderCounters() {
      if (!this.counters) return;
      const running = this.status === "running" || this.status === "queued";
      const end = running ? Date.now() / 1000 : this.lastTs;
      const elapsed = this.startedTs !== null && end ? Math.max(0, end - this.startedTs) : 0;
      this.counters.textContent = `${this.totals.turns} turns · ${this.totals.calls} tool calls · ${fmtTokens(this.totals.prompt)} prompt / ${fmtTokens(this.totals.completion)} completion tokens · ${fmtSeconds(elapsed)} · ${this.events.length} events`;
    }

    setStatus(status, reason) {
      this.status = status;
      // "succeeded" only means the agent stopped: show "finished" and, once known, what the tests said.
      const shown = status === "succeeded" ? `finished${this.outcome ? ", " + (OUTCOMES[this.outcome] || this.outcome) : ""}` : status;
      if (this.statusBadge) { this.statusBadge.textContent = shown; this.statusBadge.className = `badge ${status} ${this.outcome}`; this.statusBadge.title = reason || ""; }
      if (this.progress) this.progress.hidden = !(status === "running" || status === "queued");
      this.root.dataset.status = status;
      if (this.reasonLine) { this.reasonLine.textContent = reason || ""; this.reasonLine.hidden = !reason; }
      // Page actions (cancel, create branch) and notes ("Task 3 queued.") follow the live status.
      if (window.flowstateControls) window.flowstateControls.apply(status);
      if (!LIVE.includes(status)) this.following = false;
      if (this.jump) this.updateJump();
      this.renderCounters();
    }

    // --- transport ---
    async loadAll() {
      for (;;) {
        const response = await fetch(`${this.apiBase}/events/?after=${this.lastSeq}&limit=2000`, { credentials: "same-origin" });
        if (!response.ok) throw new Error(`events request failed: ${response.status}`);
        const batch = await response.json();
        for (const event of batch) this.add(event);
        if (batch.length < 2000) break;
      }
      this.renderCounters();
    }

    connect() {
      const scheme = location.protocol === "https:" ? "wss" : "ws";
      this.closedByUs = false;
      const socket = new WebSocket(`${scheme}://${location.host}/ws/tasks/${this.taskId}/events/?after=${this.lastSeq}`);
      this.socket = socket;
      this.setConnection("connecting");
      socket.onopen = () => this.setConnection("live");
      socket.onmessage = (message) => {
        const data = JSON.parse(message.data);
        if (data.type === "events") for (const event of data.events) this.add(event);
        else if (data.type === "status") { this.replaying = false; this.setStatus(data.status, data.reason); this.scheduleFrame(); }
      };
      socket.onclose = (closeEvent) => {
        if (this.socket !== socket) return;
        this.socket = null;
        if (closeEvent.code >= 4400 && closeEvent.code < 4500) { this.setConnection(`closed (${closeEvent.code})`); return; }
        if (this.closedByUs || this.status === "succeeded" || this.status === "failed" || this.status === "cancelled") { this.setConnection("finished"); return; }
        this.reconnects += 1;
        this.setConnection("reconnecting");
        setTimeout(() => this.connect(), Math.min(5000, 250 * this.reconnects));
      };
    }

    /* Used by tests and the "reconnect" button: drop the socket as a network failure would. */
    dropConnection() { if (this.socket) this.socket.close(); }

    setConnection(state) { if (this.connection) this.connection.textContent = state; this.root.dataset.connection = state; }
  }

  window.FlowstateTrace = TraceView;
  document.addEventListener("DOMContentLoaded", () => {
    for (const root of document.querySelectorAll("[data-trace]")) {
      const view = new TraceView(root, { taskId: Number(root.dataset.taskId), status: root.dataset.status, reason: root.dataset.reason, outcome: root.dataset.outcome });
      root.traceView = view;
      if (!window.flowstateTrace) window.flowstateTrace = view;
      // A finished task's page listens too: a follow-up (from this page, the API or a teammate's view) continues it.
      const live = root.dataset.live === "true";
      if (live) view.connect();
      else view.loadAll().catch((error) => view.setConnection(String(error)));
      const reconnect = root.querySelector("[data-role=reconnect]");
      if (reconnect) reconnect.addEventListener("click", () => view.dropConnection());
    }
  });
})();
