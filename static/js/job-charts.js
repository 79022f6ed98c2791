// Job page chart: training step and the newest committed step of each tier over time.
//
// Data from GET {data-history-url}?since=...&until=... (the session cookie authenticates
// it): `progress` (highest step per time bucket) and `committed[tier]` (one point per
// commit: the newest committed step from that time on). Every series is drawn as a step
// function on one shared time axis: at each time the chart shows the newest value reported
// up to then, so the gap between the training line and a tier's line is that tier's lag.
// The whole range is fetched again every data-refresh-s seconds while the tab is visible.
//
// When the plot has drawn, the figure gets data-points (time points) and data-series.
(function () {
  "use strict";

  const HEIGHT = 260;
  const SERIES = [
    { key: "progress", label: "training step", stroke: "#18212b", width: 2 },
    { key: "memory", label: "memory", stroke: "#1f77b4", width: 1.5 },
    { key: "peer", label: "peer", stroke: "#2ca02c", width: 1.5 },
    { key: "persistent", label: "persistent", stroke: "#d62728", width: 1.5 },
  ];

  const root = document.getElementById("job-chart");
  if (!root || typeof window.uPlot === "undefined") {
    return;
  }
  const fig = root.querySelector("#step-chart");
  const box = fig.querySelector(".plot");
  const historyUrl = root.dataset.historyUrl;
  const refreshMs = Math.max(1000, parseFloat(root.dataset.refreshS || "5") * 1000);
  let rangeS = 900;
  let timer = null;
  let plot = null;
  let generation = 0; // bumps on a range change so late answers of the old range are dropped

  function showNote(text) {
    if (plot) {
      plot.destroy();
      plot = null;
    }
    box.textContent = "";
    const note = document.createElement("p");
    note.className = "note";
    note.textContent = text;
    box.appendChild(note);
    fig.dataset.points = "0";
  }

  function points(list) {
    return (list || [])
      .map(function (p) { return [Date.parse(p.ts) / 1000, Number(p.step)]; })
      .filter(function (p) { return !Number.isNaN(p[0]); })
      .sort(function (a, b) { return a[0] - b[0]; });
  }

  // One x axis (every time any series changes) and each series carried forward.
  function toData(body, start, end) {
    const lists = SERIES.map(function (s) {
      return points(s.key === "progress" ? body.progress : (body.committed || {})[s.key]);
    });
    const xs = new Set();
    lists.forEach(function (list) { list.forEach(function (p) { xs.add(p[0]); }); });
    if (xs.size === 0) {
      return null;
    }
    xs.add(end);
    const keys = Array.from(xs).filter(function (x) { return x >= start; }).sort(function (a, b) { return a - b; });
    const data = [keys];
    lists.forEach(function (list) {
      let i = 0;
      let value = null;
      data.push(keys.map(function (x) {
        while (i < list.length && list[i][0] <= x) {
          value = list[i][1];
          i += 1;
        }
        return value;
      }));
    });
    return data;
  }

  function makePlot(data) {
    const opts = {
      width: Math.max(300, box.clientWidth),
      height: HEIGHT,
      scales: { x: { time: true } },
      series: [{}].concat(SERIES.map(function (s) {
        return {
          label: s.label, stroke: s.stroke, width: s.width, paths: window.uPlot.paths.stepped({ align: 1 }),
          value: function (u, v) { return v === null || v === undefined ? "—" : String(v); },
        };
      })),
      axes: [{}, { size: 70 }],
    };
    box.textContent = "";
    plot = new window.uPlot(opts, data, box);
  }

  async function refresh() {
    const gen = generation;
    const end = Date.now() / 1000;
    const start = end - rangeS;
    const params = new URLSearchParams({
      since: new Date(start * 1000).toISOString(),
      until: new Date(end * 1000).toISOString(),
    });
    try {
      const resp = await fetch(historyUrl + "?" + params.toString(), {
        headers: { Accept: "application/json" },
        credentials: "same-origin",
      });
      if (resp.status === 401) {
        window.location.assign("/login?next=" + encodeURIComponent(window.location.pathname));
        return;
      }
      if (!resp.ok) {
        throw new Error("history request failed with HTTP " + resp.status);
      }
      const body = await resp.json();
      if (gen !== generation) {
        return;
      }
      const data = toData(body, start, end);
      if (!data) {
        showNote("No progress or commits in this range yet.");
        return;
      }
      if (plot) {
        plot.setData(data);
      } else {
        makePlot(data);
      }
      fig.dataset.points = String(data[0].length);
      fig.dataset.series = String(SERIES.length);
    } catch (err) {
      showNote("Could not load the history: " + err.message);
    }
  }

  function schedule() {
    clearTimeout(timer);
    timer = setTimeout(async function tick() {
      if (document.visibilityState === "visible") {
        await refresh();
      }
      schedule();
    }, refreshMs);
  }

  root.querySelectorAll("button[data-range]").forEach(function (button) {
    button.addEventListener("click", function () {
      rangeS = parseInt(button.dataset.range, 10);
      generation += 1;
      root.querySelectorAll("button[data-range]").forEach(function (b) {
        b.setAttribute("aria-pressed", b === button ? "true" : "false");
      });
      refresh().then(schedule);
    });
  });

  window.addEventListener("resize", function () {
    if (plot) {
      plot.setSize({ width: Math.max(300, box.clientWidth), height: HEIGHT });
    }
  });

  refresh().then(schedule);
})();
