/* The environment page while a setup is pending or running: polls the repository's environment API and
 * shows the current step, the elapsed time, the log so far and, at the end, the outcome in words with
 * the next thing to try, without a reload. */
(function () {
  "use strict";
  const POLL_MS = 1500;

  function show(root, role, text) {
    const node = root.querySelector(`[data-role=${role}]`);
    if (node) { node.textContent = text || ""; }
    return node;
  }

  function toggle(root, role, visible) {
    const node = root.querySelector(`[data-role=${role}]`);
    if (node) node.hidden = !visible;
  }

  function render(root, state) {
    root.dataset.status = state.status;
    root.dataset.active = String(state.active);
    show(root, "env-status", state.status);
    show(root, "env-step", state.step);
    show(root, "env-elapsed", state.elapsed_s === null ? "" : `${Math.round(state.elapsed_s)} s`);
    toggle(root, "env-progress", state.active);
    show(root, "env-failure", state.failure);
    toggle(root, "env-failure", !!state.failure);
    show(root, "env-next-text", state.next_step);
    toggle(root, "env-next", !!state.next_step);
    show(root, "env-baseline-text", state.baseline);
    toggle(root, "env-baseline", !!state.baseline);
    const log = show(root, "env-log", state.log_tail);
    toggle(root, "env-log-box", !!state.log_tail);
    if (log && state.active) log.scrollTop = log.scrollHeight;
    if (window.flowstateControls) window.flowstateControls.apply(state.status.replace(/ /g, "-"));
  }

  async function poll(root) {
    try {
      const response = await fetch(root.dataset.url, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (!response.ok) throw new Error(`the environment could not be read (HTTP ${response.status})`);
      const data = await response.json();
      render(root, data.state);
      if (data.state.active) setTimeout(() => poll(root), POLL_MS);
    } catch (error) {
      show(root, "env-step", `${error.message}; retrying`);
      setTimeout(() => poll(root), POLL_MS * 4);
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    for (const root of document.querySelectorAll("[data-environment]")) {
      if (window.flowstateControls) window.flowstateControls.apply((root.querySelector("[data-role=env-status]").textContent || "").replace(/ /g, "-"));
      if (root.dataset.active === "true") poll(root);
    }
  });
})();
