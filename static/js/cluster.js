// Cluster page: the poll (#cluster-poll) is answered with 204 when nothing changed, or with
// only the changed parts out of band, so nothing re-renders the "updated" time. This stamps
// it from each answer's Date header (the server's clock); a failed poll marks it stale.
(function () {
  "use strict";

  function utc(date) {
    const iso = date.toISOString(); // 2024-05-01T12:00:03.000Z, as the server's `ts` filter
    return iso.slice(0, 10) + " " + iso.slice(11, 19) + " UTC";
  }

  document.addEventListener("htmx:afterRequest", function (event) {
    if (!event.target || event.target.id !== "cluster-poll") {
      return;
    }
    const time = document.getElementById("cluster-updated");
    if (!time) {
      return;
    }
    if (!event.detail.successful) {
      time.dataset.stale = "true";
      time.title = "the last update failed; showing the state of this time";
      return;
    }
    const header = event.detail.xhr && event.detail.xhr.getResponseHeader("Date");
    const date = header ? new Date(header) : new Date();
    if (isNaN(date.getTime())) {
      return;
    }
    time.dateTime = date.toISOString();
    time.textContent = utc(date);
    delete time.dataset.stale;
    time.removeAttribute("title");
  });
})();
