// Task page: follows the semantic index build of the task's snapshot (BM25 stand-in until ready).
(function () {
  const box = document.querySelector('[data-role="index-progress"]');
  if (!box) return;
  const label = box.querySelector('[data-role="index-progress-label"]');
  let bar = box.querySelector("progress");
  async function poll() {
    let progress = null;
    try {
      const response = await fetch(box.dataset.url, {credentials: "same-origin"});
      if (response.ok) progress = (await response.json()).progress;
    } catch (error) { /* keep the last state shown; try again */ }
    if (progress) {
      box.hidden = false;
      box.dataset.state = progress.state;
      label.textContent = progress.label;
      if (!bar) { bar = document.createElement("progress"); box.appendChild(bar); }
      bar.max = progress.chunks_total; bar.value = progress.chunks_done;
    }
    // Poll while queued, building or not started yet; stop once ready, failed, cancelled or stalled.
    if (!progress || progress.state === "queued" || progress.state === "building") setTimeout(poll, 2000);
  }
  // A finished task is not followed: its build, if any, is shown as it was when the page was made.
  const following = ["none", "queued", "building"];
  if (box.dataset.live === "1" && following.includes(box.dataset.state)) setTimeout(poll, 2000);
})();
