// The HTML scorecard's failure browser (inlined by report_html.py). It only shows and hides
// the example rows the page already holds; it reads text with textContent and writes with
// textContent, so no model output is ever parsed as markup.
(function () {
  "use strict";
  var PAGE = 50;  // rows shown at once: a long suite stays quick to scroll
  var rows = Array.prototype.slice.call(document.querySelectorAll("#ex-list .ex"));
  var data = rows.map(function (row) {
    return { row: row, set: row.dataset.set, category: row.dataset.category,
             results: JSON.parse(row.dataset.results), text: row.textContent.toLowerCase() };
  });
  var labels = Array.prototype.map.call(document.querySelectorAll("#f-model option"), function (o) { return o.value; })
    .filter(function (v) { return v !== ""; });
  var base = labels[0];
  var el = {
    set: document.getElementById("f-set"), category: document.getElementById("f-category"),
    model: document.getElementById("f-model"), status: document.getElementById("f-status"),
    text: document.getElementById("f-text"), counts: document.getElementById("counts"),
    more: document.getElementById("more")
  };
  var limit = PAGE;

  function judged(d, model) {
    // The models whose result the status filter reads: the chosen one, or every model that ran.
    return model ? [model].filter(function (m) { return m in d.results; }) : Object.keys(d.results);
  }

  function statusMatches(d, status, model) {
    if (!status) return true;
    var ms = judged(d, model);
    if (status === "failed") return ms.some(function (m) { return d.results[m] === false; });
    if (status === "passed") return ms.length > 0 && ms.every(function (m) { return d.results[m] === true; });
    // regressed / fixed compare a candidate with the base: the chosen candidate, or any candidate.
    var cands = (model && model !== base ? [model] : labels.slice(1)).filter(function (m) { return m in d.results; });
    var b = d.results[base];
    if (status === "regressed") return b === true && cands.some(function (m) { return d.results[m] === false; });
    if (status === "fixed") return b === false && cands.some(function (m) { return d.results[m] === true; });
    return true;
  }

  function apply(resetLimit) {
    if (resetLimit) limit = PAGE;
    var f = { set: el.set.value, category: el.category.value, model: el.model.value,
              status: el.status.value, q: el.text.value.trim().toLowerCase() };
    var matched = 0, shown = 0, failed = {};
    labels.forEach(function (m) { failed[m] = 0; });
    data.forEach(function (d) {
      var ok = (!f.set || d.set === f.set) && (!f.category || d.category === f.category) &&
               (!f.model || f.model in d.results) && statusMatches(d, f.status, f.model) &&
               (!f.q || d.text.indexOf(f.q) !== -1);
      if (ok) {
        matched += 1;
        Object.keys(d.results).forEach(function (m) { if (d.results[m] === false) failed[m] += 1; });
      }
      var visible = ok && matched <= limit;
      if (visible) shown += 1;
      d.row.hidden = !visible;
      Array.prototype.forEach.call(d.row.querySelectorAll(".col.out"), function (col) {
        col.classList.toggle("focus", !!f.model && col.dataset.model === f.model);
      });
    });
    var parts = labels.map(function (m) { return m + " failed " + failed[m]; });
    el.counts.textContent = "";
    var strong = document.createElement("strong");
    strong.textContent = shown < matched ? "Showing " + shown + " of " + matched : matched + " of " + data.length;
    el.counts.appendChild(strong);
    el.counts.appendChild(document.createTextNode(
      (shown < matched ? " matching examples (" + data.length + " in all)" : " examples") +
      (matched ? " · " + parts.join(" · ") : "")));
    el.counts.dataset.matched = String(matched);
    el.counts.dataset.shown = String(shown);
    el.more.hidden = shown >= matched;
    el.more.textContent = "Show " + Math.min(PAGE, matched - shown) + " more";
    var state = new URLSearchParams();
    Object.keys(f).forEach(function (k) { if (f[k]) state.set(k, f[k]); });
    // The filters live in the URL's fragment (a link opens filtered); a section anchor such as
    // #gates is left alone while no filter is set.
    var hash = state.toString(), current = location.hash.replace(/^#/, "");
    if (hash !== current && (hash || current.indexOf("=") !== -1)) {
      history.replaceState(null, "", hash ? "#" + hash : location.pathname + location.search);
    }
  }

  function restore() {
    // A link such as scorecard.html#category=tool_call&status=failed opens filtered.
    var state = new URLSearchParams(location.hash.replace(/^#/, ""));
    [["set", el.set], ["category", el.category], ["model", el.model], ["status", el.status]].forEach(function (p) {
      var v = state.get(p[0]);
      if (v !== null && Array.prototype.some.call(p[1].options, function (o) { return o.value === v; })) p[1].value = v;
    });
    if (state.get("q") !== null) el.text.value = state.get("q");
  }

  [el.set, el.category, el.model, el.status].forEach(function (s) {
    s.addEventListener("change", function () { apply(true); });
  });
  el.text.addEventListener("input", function () { apply(true); });
  document.getElementById("filters").addEventListener("submit", function (e) { e.preventDefault(); });
  el.more.addEventListener("click", function () { limit += PAGE; apply(false); });

  // A category label under a chart filters the browser to that set and category.
  Array.prototype.forEach.call(document.querySelectorAll("svg .xlab.link"), function (t) {
    function go() {
      var cat = t.dataset.category === "all" ? "" : t.dataset.category;
      if (!Array.prototype.some.call(el.set.options, function (o) { return o.value === t.dataset.set; })) return;
      el.set.value = t.dataset.set;
      el.category.value = Array.prototype.some.call(el.category.options, function (o) { return o.value === cat; }) ? cat : "";
      apply(true);
      document.getElementById("examples").scrollIntoView();
    }
    t.addEventListener("click", go);
    t.addEventListener("keydown", function (e) { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); go(); } });
  });

  if (location.hash.length > 1 && location.hash.indexOf("=") !== -1) restore();
  apply(true);
}());
