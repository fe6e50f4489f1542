// Markdown to DOM nodes for model output. Every piece of model text becomes a text node or a
// textContent; nothing is parsed as HTML. Links keep only http and https URLs; anything else is
// shown as the text the model wrote. Unclosed constructs (a fence still streaming) render as far
// as they go.
"use strict";

window.tidalMarkdown = (() => {
  const MAX_DEPTH = 8;
  const PUNCT = "\\`*_{}[]()#+-.!|~<>\"'";

  function el(tag, cls) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    return e;
  }

  // The URL to put in href, or null: absolute http(s) only (no javascript:, data:, relative paths).
  function safeHref(raw) {
    const s = String(raw).trim();
    if (!/^https?:\/\//i.test(s)) return null;
    let url;
    try {
      url = new URL(s);
    } catch {
      return null;
    }
    return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
  }

  function link(href, parent) {
    const a = el("a");
    a.href = href;
    a.target = "_blank";
    a.rel = "noopener noreferrer nofollow";
    parent.appendChild(a);
    return a;
  }

  // Index of the bracket closing the one at `open`, or -1.
  function matching(src, open, left, right) {
    let depth = 0;
    for (let i = open; i < src.length; i++) {
      const c = src[i];
      if (c === "\\") i++;
      else if (c === left) depth++;
      else if (c === right && --depth === 0) return i;
    }
    return -1;
  }

  const EMPHASIS = [["**", "strong"], ["__", "strong"], ["~~", "del"], ["*", "em"], ["_", "em"]];
  const BARE_URL = /https?:\/\/[^\s<>"'`]+/y;

  // Inline Markdown of `src` appended to `out` as nodes.
  function inline(src, out, depth, inLink) {
    let buf = "";
    const flush = () => {
      if (buf) out.appendChild(document.createTextNode(buf));
      buf = "";
    };
    let i = 0;
    while (i < src.length) {
      const c = src[i];
      if (c === "\\" && i + 1 < src.length && PUNCT.includes(src[i + 1])) {
        buf += src[i + 1];
        i += 2;
        continue;
      }
      if (c === "\n") {
        flush();
        out.appendChild(el("br"));
        i++;
        continue;
      }
      if (c === "`") {
        let n = 1;
        while (src[i + n] === "`") n++;
        const fence = "`".repeat(n);
        const end = src.indexOf(fence, i + n);
        if (end >= 0) {
          flush();
          const code = el("code");
          code.textContent = src.slice(i + n, end);
          out.appendChild(code);
          i = end + n;
        } else {
          buf += fence;
          i += n;
        }
        continue;
      }
      if (depth < MAX_DEPTH && (c === "*" || c === "_" || c === "~")) {
        const done = emphasis(src, i, out, depth, inLink, flush);
        if (done > i) {
          i = done;
          continue;
        }
      }
      if (c === "[" || (c === "!" && src[i + 1] === "[")) {
        const done = inLink ? -1 : mdLink(src, i, out, depth, flush);
        if (done > i) {
          i = done;
          continue;
        }
      }
      if (c === "h" && !inLink && (src.startsWith("http://", i) || src.startsWith("https://", i))
          && (i === 0 || !/[\w/]/.test(src[i - 1]))) {
        BARE_URL.lastIndex = i;
        const m = BARE_URL.exec(src);
        let text = m ? m[0].replace(/[.,;:!?)\]]+$/, "") : "";
        const href = text && safeHref(text);
        if (href) {
          flush();
          link(href, out).textContent = text;
          i += text.length;
          continue;
        }
      }
      buf += c;
      i++;
    }
    flush();
  }

  // Emphasis opening at i: returns the index after its closer, or i when it is not one.
  function emphasis(src, i, out, depth, inLink, flush) {
    for (const [mark, tag] of EMPHASIS) {
      if (!src.startsWith(mark, i)) continue;
      const start = i + mark.length;
      if (start >= src.length || /\s/.test(src[start]) || src[start] === mark[0]) continue;
      if (mark[0] === "_" && i > 0 && /\w/.test(src[i - 1])) continue;  // snake_case stays text
      // The closer: not after a space, and a single mark is not half of a double one.
      const doubled = (at) => mark.length === 1 && src[at + 1] === mark;
      let end = src.indexOf(mark, start + 1);
      while (end >= 0 && (/\s/.test(src[end - 1]) || doubled(end))) end = src.indexOf(mark, end + (doubled(end) ? 2 : 1));
      if (end < 0) continue;
      if (mark[0] === "_" && /\w/.test(src[end + mark.length] || "")) continue;
      flush();
      const e = el(tag);
      inline(src.slice(start, end), e, depth + 1, inLink);
      out.appendChild(e);
      return end + mark.length;
    }
    return i;
  }

  // [text](url) or ![alt](url) at i: returns the index after it, or i when it is not a link.
  function mdLink(src, i, out, depth, flush) {
    const image = src[i] === "!";
    const open = image ? i + 1 : i;
    const close = matching(src, open, "[", "]");
    if (close < 0 || src[close + 1] !== "(") return i;
    const end = matching(src, close + 1, "(", ")");
    if (end < 0) return i;
    const text = src.slice(open + 1, close);
    let target = src.slice(close + 2, end).trim();
    target = target.replace(/\s+("[^"]*"|'[^']*')$/, "");  // an optional title
    if (target.startsWith("<") && target.endsWith(">")) target = target.slice(1, -1);
    const href = safeHref(target);
    flush();
    if (href === null) {  // not a web link: show exactly what was written
      out.appendChild(document.createTextNode(src.slice(i, end + 1)));
      return end + 1;
    }
    const a = link(href, out);
    if (image) {
      a.className = "image-link";
      a.textContent = "image: " + (text || href);  // images are not loaded from model-chosen URLs
    } else {
      inline(text, a, depth + 1, true);
    }
    return end + 1;
  }

  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}> ?(.*)$/;
  const ITEM = /^( {0,3})([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

  function startsBlock(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
  }

  function cells(line) {
    let s = line.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
    return s.split(/(?<!\\)\|/).map((c) => c.trim());
  }

  function codeBlock(lang, body, out) {
    const box = el("div", "code");
    const head = el("div", "code-head");
    const label = el("span", "code-lang");
    label.textContent = lang || "text";
    const copy = el("button", "copy");
    copy.type = "button";
    copy.textContent = "copy";
    copy.addEventListener("click", () => {
      const done = (t) => { copy.textContent = t; setTimeout(() => { copy.textContent = "copy"; }, 1200); };
      if (navigator.clipboard) navigator.clipboard.writeText(body).then(() => done("copied"), () => done("failed"));
      else done("failed");
    });
    head.append(label, copy);
    const pre = el("pre");
    const code = el("code");
    code.textContent = body;
    pre.appendChild(code);
    box.append(head, pre);
    out.appendChild(box);
  }

  // Block Markdown of `text` appended to `out`.
  function blocks(text, out, depth) {
    const lines = text.split("\n");
    let i = 0;
    let para = [];
    const endPara = () => {
      if (!para.length) return;
      const p = el("p");
      inline(para.join("\n"), p, depth, false);
      out.appendChild(p);
      para = [];
    };
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (!line.trim()) {
        endPara();
        i++;
      } else if ((m = FENCE.exec(line))) {
        endPara();
        const mark = m[1];
        const body = [];
        i++;
        while (i < lines.length && !(lines[i].trim().startsWith(mark) && /^[`~]+$/.test(lines[i].trim()))) {
          body.push(lines[i]);
          i++;
        }
        i++;  // the closing fence (or the end of a fence still streaming)
        codeBlock(m[2].replace(/[^\w+#.-]/g, ""), body.join("\n"), out);
      } else if ((m = HEADING.exec(line))) {
        endPara();
        const h = el("h" + Math.min(6, m[1].length + 2));
        inline(m[2], h, depth, false);
        out.appendChild(h);
        i++;
      } else if (RULE.test(line) && !para.length) {
        out.appendChild(el("hr"));
        i++;
      } else if (QUOTE.test(line) && depth < MAX_DEPTH) {
        endPara();
        const quoted = [];
        while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
          quoted.push(m[1]);
          i++;
        }
        const q = el("blockquote");
        blocks(quoted.join("\n"), q, depth + 1);
        out.appendChild(q);
      } else if ((m = ITEM.exec(line)) && depth < MAX_DEPTH) {
        endPara();
        const ordered = /\d/.test(m[2]);
        const list = el(ordered ? "ol" : "ul");
        if (ordered && parseInt(m[2], 10) !== 1) list.start = parseInt(m[2], 10);
        while (i < lines.length && (m = ITEM.exec(lines[i])) && /\d/.test(m[2]) === ordered) {
          const indent = m[1].length + m[2].length + 1;
          const item = [m[3]];
          i++;
          while (i < lines.length) {
            const next = lines[i];
            if (!next.trim()) {
              if (i + 1 < lines.length && /^\s{2,}\S/.test(lines[i + 1])) { item.push(""); i++; continue; }
              break;
            }
            if (/^\s{2,}/.test(next)) item.push(next.slice(Math.min(indent, next.search(/\S/))));
            else if (!startsBlock(next)) item.push(next);  // a lazy continuation line
            else break;
            i++;
          }
          const li = el("li");
          blocks(item.join("\n"), li, depth + 1);
          list.appendChild(li);
        }
        out.appendChild(list);
      } else if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1])
                 && lines[i + 1].includes("-") && !para.length) {
        const head = cells(line);
        const table = el("table");
        const tr = el("tr");
        for (const c of head) { const th = el("th"); inline(c, th, depth, false); tr.appendChild(th); }
        table.appendChild(el("thead")).appendChild(tr);
        const tbody = table.appendChild(el("tbody"));
        i += 2;
        while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
          const row = el("tr");
          for (const c of cells(lines[i]).slice(0, head.length)) {
            const td = el("td");
            inline(c, td, depth, false);
            row.appendChild(td);
          }
          tbody.appendChild(row);
          i++;
        }
        const wrap = el("div", "table");
        wrap.appendChild(table);
        out.appendChild(wrap);
      } else {
        para.push(line);
        i++;
      }
    }
    endPara();
  }

  function render(text) {
    const frag = document.createDocumentFragment();
    blocks(String(text).replace(/\r\n?/g, "\n"), frag, 0);
    return frag;
  }

  return { render, safeHref };
})();
