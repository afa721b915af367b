// Render every <pre class="mermaid"> on the page with the vendored mermaid.min.js (no network).
// <html data-mermaid="done|error|missing"> tells tests/test_docs_site.py's browser check how it went.
(function () {
  function render() {
    if (!window.mermaid) { document.documentElement.dataset.mermaid = "missing"; return; }
    var dark = document.body.dataset.theme === "dark" ||
      (document.body.dataset.theme !== "light" && window.matchMedia("(prefers-color-scheme: dark)").matches);
    window.mermaid.initialize({ startOnLoad: false, securityLevel: "strict", theme: dark ? "dark" : "default" });
    window.mermaid.run({ querySelector: "pre.mermaid" })
      .then(function () { document.documentElement.dataset.mermaid = "done"; })
      .catch(function (e) { document.documentElement.dataset.mermaid = "error"; console.error(e); });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", render); else render();
})();
