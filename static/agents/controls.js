/* Page controls that follow a live status. An element with data-show-when="queued running" is shown only
 * while the status is one of those: the server refuses the action in any other state (409), so a page that
 * kept offering it would only lead to an error. A flash message tagged while-<status> ("Task 3 queued.")
 * describes a state the page has left once the status changes, so it goes then. */
(function () {
  "use strict";

  function apply(status, scope) {
    for (const node of (scope || document).querySelectorAll("[data-show-when]")) {
      node.hidden = !node.dataset.showWhen.split(/\s+/).includes(status);
    }
    for (const note of document.querySelectorAll(".messages li")) {
      const states = [...note.classList].filter((name) => name.startsWith("while-")).map((name) => name.slice(6));
      if (states.length && !states.includes(status)) note.remove();
    }
    for (const list of document.querySelectorAll(".messages")) if (!list.children.length) list.remove();
  }

  window.flowstateControls = { apply };
})();
