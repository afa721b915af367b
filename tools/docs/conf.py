# Sphinx configuration of the docs site. tools/docs/build.py stages the cleaned notebooks in a temporary
# source folder and runs `sphinx-build -c tools/docs`, so this file and static/ are used where they are.
project = "minivllm"
html_title = "minivllm"
extensions = ["myst_nb"]
nb_execution_mode = "off"  # build.py has run the chapters (execute.py): Sphinx shows the staged outputs
nb_output_stderr = "show"
nb_merge_streams = True
myst_heading_anchors = 3
html_theme = "furo"
html_static_path = ["static"]  # mermaid.min.js (vendored), mermaid-init.js, minivllm.css, seed-text.css
html_js_files = ["mermaid.min.js", "mermaid-init.js"]
html_css_files = ["minivllm.css"]
html_copy_source = False
html_show_sourcelink = False
html_show_sphinx = False
exclude_patterns = ["**.ipynb_checkpoints"]
suppress_warnings = [
    "myst.header",
    "mystnb.unknown_mime_type",
    "misc.highlighting_failure",
    "toc.not_included",
]
