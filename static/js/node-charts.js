// Node page charts: per-GPU history from the samples API, drawn with uPlot.
//
// Each <figure data-metric="..."> inside #charts gets one plot with a line per GPU. Samples
// come from GET {data-samples-url}?metric=...&since=... (the session cookie authenticates
// it). Points are averaged into time buckets so a chart never holds more than MAX_POINTS
// per GPU: 15 min -> 2 s buckets, 1 h -> 5 s, 24 h -> 120 s. The request also carries
// `step` (the bucket width in seconds) so a server that downsamples can send fewer rows;
// bucketing here is then a no-op. After the first load only the newest bucket onward is
// fetched again, every data-refresh-s seconds while the tab is visible.
//
// When a plot has drawn, its figure gets data-points (points per GPU) and data-gpus.
//
// Each answer says where its rows came from (`source`: "prometheus" with
// TIERWATCH_PROMETHEUS_URL set, else "database"; `source_error` when Prometheus failed and
// the database answered instead, `source_note` when Prometheus had no series): #chart-source
// shows it, and its data-source attribute holds the source of the latest answer.
(function () {
  "use strict";

  const MAX_POINTS = 720;
  const HEIGHT = 220;
  const COLORS = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
  ];

  const root = document.getElementById("charts");
  if (!root || typeof window.uPlot === "undefined") {
    return;
  }
  const samplesUrl = root.dataset.samplesUrl;
  const refreshMs = Math.max(1000, parseFloat(root.dataset.refreshS || "5") * 1000);
  let rangeS = 900;
  let timer = null;
  let generation = 0; // bumps on a range change so late answers of the old range are dropped

  const charts = Array.from(root.querySelectorAll("figure[data-metric]")).map(function (fig) {
    return {
      fig: fig,
      box: fig.querySelector(".plot"),
      metric: fig.dataset.metric,
      unit: fig.dataset.unit || "",
      plot: null,
      gpuKey: "",
      buckets: new Map(), // bucket start (s) -> Map(gpu -> [sum, count])
    };
  });

  const sourceLine = document.getElementById("chart-source");

  function showSource(body) {
    if (!sourceLine || !body.source) {
      return;
    }
    let text = body.source === "prometheus" ? "Charts from Prometheus" : "Charts from tierwatch's database";
    if (body.source_error) {
      text += " (" + body.source_error + ")";
    } else if (body.source_note) {
      text += " (" + body.source_note + ")";
    }
    sourceLine.dataset.source = body.source;
    sourceLine.textContent = text;
  }

  function bucketWidth() {
    return Math.max(1, Math.ceil(rangeS / MAX_POINTS));
  }

  function showNote(chart, text) {
    if (chart.plot) {
      chart.plot.destroy();
      chart.plot = null;
      chart.gpuKey = "";
    }
    chart.box.textContent = "";
    const note = document.createElement("p");
    note.className = "note";
    note.textContent = text;
    chart.box.appendChild(note);
    chart.fig.dataset.points = "0";
  }

  function addRows(chart, rows, step) {
    for (const row of rows) {
      const value = row[chart.metric];
      if (value === null || value === undefined) {
        continue;
      }
      const t = Date.parse(row.ts) / 1000;
      if (Number.isNaN(t)) {
        continue;
      }
      const key = Math.floor(t / step) * step;
      let perGpu = chart.buckets.get(key);
      if (!perGpu) {
        perGpu = new Map();
        chart.buckets.set(key, perGpu);
      }
      const acc = perGpu.get(row.gpu) || [0, 0];
      acc[0] += Number(value);
      acc[1] += 1;
      perGpu.set(row.gpu, acc);
    }
  }

  function toSeries(chart, start) {
    for (const key of chart.buckets.keys()) {
      if (key < start) {
        chart.buckets.delete(key);
      }
    }
    const keys = Array.from(chart.buckets.keys()).sort(function (a, b) { return a - b; });
    const gpus = new Set();
    for (const perGpu of chart.buckets.values()) {
      for (const gpu of perGpu.keys()) {
        gpus.add(gpu);
      }
    }
    const gpuList = Array.from(gpus).sort(function (a, b) { return a - b; });
    const data = [keys];
    for (const gpu of gpuList) {
      data.push(keys.map(function (key) {
        const acc = chart.buckets.get(key).get(gpu);
        return acc ? acc[0] / acc[1] : null;
      }));
    }
    return { keys: keys, gpus: gpuList, data: data };
  }

  function makePlot(chart, gpus, data) {
    const unit = chart.unit;
    const fmt = function (v) { return v === null || v === undefined ? "—" : v.toFixed(1) + " " + unit; };
    const series = [{}].concat(gpus.map(function (gpu, i) {
      return { label: "GPU " + gpu, stroke: COLORS[i % COLORS.length], width: 1.5, value: function (u, v) { return fmt(v); } };
    }));
    const opts = {
      width: Math.max(300, chart.box.clientWidth),
      height: HEIGHT,
      series: series,
      scales: { x: { time: true } },
      axes: [{}, { values: function (u, vals) { return vals.map(function (v) { return v + " " + unit; }); }, size: 60 }],
    };
    chart.box.textContent = "";
    chart.plot = new window.uPlot(opts, data, chart.box);
    chart.gpuKey = gpus.join(",");
  }

  function draw(chart, start) {
    const s = toSeries(chart, start);
    if (s.keys.length === 0 || s.gpus.length === 0) {
      showNote(chart, "No samples in this range yet.");
      return;
    }
    if (chart.plot && chart.gpuKey === s.gpus.join(",")) {
      chart.plot.setData(s.data);
    } else {
      if (chart.plot) {
        chart.plot.destroy();
      }
      makePlot(chart, s.gpus, s.data);
    }
    chart.fig.dataset.points = String(s.keys.length);
    chart.fig.dataset.gpus = String(s.gpus.length);
  }

  async function load(chart, full, gen) {
    const step = bucketWidth();
    const now = Date.now() / 1000;
    const start = now - rangeS;
    let since = start;
    if (!full && chart.buckets.size > 0) {
      // Re-read the newest bucket (it may have been partial) and everything after it.
      since = Math.max(start, Math.max.apply(null, Array.from(chart.buckets.keys())));
    }
    const params = new URLSearchParams({
      metric: chart.metric,
      since: new Date(since * 1000).toISOString(),
      limit: "100000",
      step: String(step),
    });
    const resp = await fetch(samplesUrl + "?" + params.toString(), {
      headers: { Accept: "application/json" },
      credentials: "same-origin",
    });
    if (resp.status === 401) {
      window.location.assign("/login?next=" + encodeURIComponent(window.location.pathname));
      return;
    }
    if (!resp.ok) {
      throw new Error("samples request failed with HTTP " + resp.status);
    }
    const body = await resp.json();
    if (gen !== generation) {
      return;
    }
    showSource(body);
    if (full) {
      chart.buckets = new Map();
    } else {
      for (const key of Array.from(chart.buckets.keys())) {
        if (key >= since) {
          chart.buckets.delete(key);
        }
      }
    }
    addRows(chart, body.samples || [], step);
    draw(chart, start);
  }

  async function refresh(full) {
    const gen = generation;
    await Promise.all(charts.map(function (chart) {
      return load(chart, full, gen).catch(function (err) {
        showNote(chart, "Could not load samples: " + err.message);
      });
    }));
  }

  function schedule() {
    clearTimeout(timer);
    timer = setTimeout(async function tick() {
      if (document.visibilityState === "visible") {
        await refresh(false);
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
      refresh(true).then(schedule);
    });
  });

  window.addEventListener("resize", function () {
    for (const chart of charts) {
      if (chart.plot) {
        chart.plot.setSize({ width: Math.max(300, chart.box.clientWidth), height: HEIGHT });
      }
    }
  });

  refresh(true).then(schedule);
})();
