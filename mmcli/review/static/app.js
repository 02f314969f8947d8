"use strict";
// The review page: a paged grid of items (never every image at once), a detail view, and edits
// sent with the token the server put in the page.

const TOKEN = document.querySelector('meta[name="review-token"]').content;
const $ = (id) => document.getElementById(id);
const grid = $("grid");
let offset = 0;
let matches = 0;
let loading = false;

function el(tag, attrs = {}, children = []) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "text") node.textContent = value;
    else if (name === "class") node.className = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) if (child) node.append(child);
  return node;
}

function query() {
  const params = new URLSearchParams({
    task: $("task").value, status: $("status").value, q: $("q").value,
    regex: $("regex").checked ? "1" : "0", sort: $("sort").value, offset: String(offset),
  });
  return `/api/items?${params}`;
}

let generation = 0;

async function load(reset) {
  if (loading && !reset) return;
  // a newer filter supersedes a page still on its way
  const mine = reset ? ++generation : generation;
  loading = true;
  if (reset) offset = 0;
  const response = await fetch(query());
  const page = await response.json();
  if (mine !== generation) return;
  loading = false;
  if (!response.ok) { $("counts").textContent = page.error; return; }
  if (reset) grid.replaceChildren();
  fillTasks(page.tasks);
  matches = page.matches;
  $("counts").textContent =
    `${page.matches} of ${page.total} items · ${page.counts.ok} ok · ${page.counts.error} with errors`;
  for (const item of page.items) grid.append(card(item));
  offset += page.items.length;
  $("more").hidden = offset >= matches;
}

function fillTasks(tasks) {
  const select = $("task");
  if (select.options.length > 1) return;
  for (const task of tasks) select.append(el("option", { value: task, text: task }));
}

function media(item, size) {
  const box = el("div", { class: "media" });
  if (item.frames.length) {
    const strip = el("div", { class: "strip" });
    item.frames.forEach((time, k) => strip.append(el("figure", {}, [
      el("img", { src: `/media/${item.id}/frame/${k}?size=256`, alt: `${time} s`, loading: "lazy" }),
      el("figcaption", { text: `${time} s` }),
    ])));
    box.append(strip);
    return box;
  }
  const img = el("img", { class: "main", src: `/media/${item.id}?size=${size}`, alt: item.key, loading: "lazy" });
  img.addEventListener("error", () => img.replaceWith(el("div", { class: "missing", text: "image missing" })));
  box.append(img);
  for (const label of item.labels) {
    for (const b of label.boxes || []) box.append(boxElement(b, item));
  }
  return box;
}

function boxElement(b, item) {
  // boxes are in pixels of the image as shown; the thumbnail keeps its aspect ratio
  const [x1, y1, x2, y2] = b.bbox;
  const style = `left:${(100 * x1) / item.width}%;top:${(100 * y1) / item.height}%;` +
    `width:${(100 * (x2 - x1)) / item.width}%;height:${(100 * (y2 - y1)) / item.height}%`;
  return el("div", { class: "box", style, "data-bbox": b.bbox.join(",") }, [
    el("span", { text: b.label == null ? "" : String(b.label) }),
  ]);
}

function labelElement(label) {
  const head = el("span", { class: "task", text: label.task || "answer" });
  const node = el("div", { class: "label", "data-task": label.task }, [head]);
  if (label.review) {
    const kind = label.review.verdict || label.review.action;
    node.append(el("span", { class: `badge ${kind}`, text: kind }));
  }
  if (label.status === "error") {
    node.append(el("div", { class: "err", text: label.error || "error" }));
  } else if (label.json && typeof label.json === "object" && !Array.isArray(label.json)) {
    const fields = el("dl", { class: "fields" });
    for (const [name, value] of Object.entries(label.json)) {
      fields.append(el("dt", { text: name }), el("dd", { text: JSON.stringify(value) }));
    }
    node.append(fields);
  } else if (label.boxes) {
    node.append(el("div", { text: `${label.boxes.length} boxes` }));
  } else {
    node.append(el("span", { class: "text", text: label.text || "" }));
  }
  return node;
}

function card(item) {
  const failed = item.labels.some((l) => l.status === "error");
  const node = el("article", { class: failed ? "card error" : "card", "data-id": item.id, "data-key": item.key }, [
    media(item, 256),
    el("div", { class: "labels" }, [el("div", { class: "key", text: item.key }), ...item.labels.map(labelElement)]),
  ]);
  node.addEventListener("click", () => openDetail(item.id));
  return node;
}

async function openDetail(id) {
  const item = await (await fetch(`/api/item/${id}`)).json();
  const panel = el("div", { class: "panel" }, [
    el("p", {}, [el("button", { type: "button", id: "close", text: "close" }), " ", el("span", { class: "key", text: item.key })]),
    media({ ...item, labels: Object.entries(item.labels).map(([task, r]) => ({ task, ...r })) }, 1024),
  ]);
  for (const [task, record] of Object.entries(item.labels)) panel.append(taskBlock(item, task, record));
  $("detail").replaceChildren(panel);
  $("detail").hidden = false;
  $("close").addEventListener("click", closeDetail);
}

function closeDetail() {
  $("detail").hidden = true;
  load(true);
}

function taskBlock(item, task, record) {
  const block = el("div", { class: "task-block", "data-task": task }, [el("h3", { text: task || "answer" })]);
  if (record.status === "error") block.append(el("div", { class: "err", text: record.error && record.error.message }));
  const isJson = record.json !== null && record.json !== undefined && !record.boxes;
  const editor = el("textarea", { class: "edit" });
  editor.value = isJson ? JSON.stringify(record.json, null, 2) : record.text || "";
  const save = el("button", { type: "button", class: "save", text: "save" });
  save.addEventListener("click", () => {
    let value = editor.value;
    if (isJson) {
      try { value = JSON.parse(editor.value); } catch (e) { alert(`not JSON: ${e.message}`); return; }
    }
    send(item.id, task, "edit", value);
  });
  const approve = el("button", { type: "button", class: "approve", text: "approve" });
  approve.addEventListener("click", () => send(item.id, task, "approve"));
  const reject = el("button", { type: "button", class: "reject", text: "reject" });
  reject.addEventListener("click", () => send(item.id, task, "reject"));
  block.append(editor, el("p", {}, [save, " ", approve, " ", reject]));
  (record.boxes || []).forEach((b, k) => {
    const remove = el("button", { type: "button", class: "delete-box", text: "delete" });
    remove.addEventListener("click", () => send(item.id, task, "delete_box", k));
    block.append(el("div", {}, [`${b.label} [${b.bbox.join(", ")}] `, remove]));
  });
  const meta = [
    ["prompt", record.prompt], ["raw text", record.raw_text], ["finish", record.finish_reason],
    ["precision", record.precision && JSON.stringify(record.precision)], ["model", record.model],
    ["latency", record.latency_ms != null ? `${record.latency_ms} ms` : null],
    ["review", record.review && JSON.stringify(record.review)],
  ];
  for (const [name, value] of meta) {
    if (value) block.append(el("div", { class: "meta" }, [el("b", { text: `${name}: ` }), value]));
  }
  return block;
}

async function send(id, task, action, value) {
  const response = await fetch("/api/review", {
    method: "POST",
    headers: { "Content-Type": "application/json", "X-Review-Token": TOKEN },
    body: JSON.stringify({ id, task, action, value }),
  });
  const answer = await response.json();
  if (!response.ok) { alert(answer.error); return; }
  document.body.dataset.saved = String(Number(document.body.dataset.saved || 0) + 1);
  openDetail(id);
}

for (const id of ["task", "status", "regex", "sort"]) $(id).addEventListener("change", () => load(true));
let typing;
$("q").addEventListener("input", () => { clearTimeout(typing); typing = setTimeout(() => load(true), 250); });
$("more").addEventListener("click", () => load(false));
new IntersectionObserver((entries) => {
  if (entries.some((e) => e.isIntersecting) && offset < matches) load(false);
}).observe($("end"));
document.addEventListener("keydown", (e) => { if (e.key === "Escape" && !$("detail").hidden) closeDetail(); });
load(true);
