// Live progress of running batches: every few seconds, /dashboard/progress for the batches on the
// page that are still active, then their bars, counts, tokens/s and ETA. The page reads the same
// without this script; it only keeps the numbers fresh.
(function () {
  "use strict";
  var POLL_MS = 2000;

  function duration(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    var s = Math.round(seconds), h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
    if (h) return h + "h " + String(m).padStart(2, "0") + "m";
    if (m) return m + "m " + String(s % 60).padStart(2, "0") + "s";
    return s + "s";
  }

  function set(root, field, text) {
    root.querySelectorAll('[data-field="' + field + '"]').forEach(function (el) { el.textContent = text; });
  }

  function update(p) {
    if (!p.active && document.getElementById("batch-id")) {
      location.reload();  // it just ended: the page now lists its output and error files
      return;
    }
    document.querySelectorAll('[data-batch-id="' + p.batch_id + '"]').forEach(function (root) {
      if (root.classList.contains("progress")) {
        var bar = root.querySelector('[data-field="bar"]');
        if (bar) bar.style.width = p.percent + "%";
        var meter = root.querySelector('[role="progressbar"]');
        if (meter) meter.setAttribute("aria-valuenow", p.percent);
        root.dataset.active = p.active ? "true" : "false";
      }
      set(root, "requests", (p.completed + p.failed) + " / " + p.total + " requests");
      set(root, "percent", p.percent + "%");
      set(root, "rate", (p.tokens_per_second === null ? "–" : p.tokens_per_second) + " tokens/s");
      set(root, "eta", "ETA " + duration(p.eta_seconds));
      set(root, "status", p.status);
      set(root, "cost", p.cost);
      set(root, "output_tokens", p.output_tokens.toLocaleString("en-US"));
      root.querySelectorAll('[data-field="status"]').forEach(function (el) {
        el.className = "status status-" + p.status;
      });
    });
    var counts = document.getElementById("counts");
    if (counts && document.getElementById("batch-id").textContent === p.batch_id) {
      set(counts, "total", p.total);
      set(counts, "completed", p.completed);
      set(counts, "failed", p.failed);
    }
  }

  function activeIds() {
    var ids = [];
    document.querySelectorAll('.progress[data-active="true"]').forEach(function (el) {
      if (ids.indexOf(el.dataset.batchId) < 0) ids.push(el.dataset.batchId);
    });
    return ids;
  }

  function poll() {
    var ids = activeIds();
    if (!ids.length) return;
    fetch("/dashboard/progress?ids=" + encodeURIComponent(ids.join(",")), {credentials: "same-origin"})
      .then(function (r) { return r.ok ? r.json() : {data: []}; })
      .then(function (body) { body.data.forEach(update); })
      .catch(function () {})
      .then(function () { setTimeout(poll, POLL_MS); });
  }

  document.addEventListener("DOMContentLoaded", function () { setTimeout(poll, POLL_MS); });
})();
