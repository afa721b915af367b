"""`file://` images under `--allowed-local-media-path` (chapter 25f `fetch_image`), pass 19B findings.

N5. A file URL was read whole before the `MINIVLLM_MAX_IMAGE_BYTES` check: one request naming an 800 MB file in
    the media folder raised the server's peak memory by 820 MB before its 400. The size is checked first and at
    most limit + 1 bytes are read.
N4. The media folder itself was "not inside the allowed local media path"; a subfolder was "no such file"; and
    `file://imgs/cat.png` silently dropped its host part ("imgs").
"""

import json
import subprocess
import sys

import pytest

from minivllm.multimodal.utils import fetch_image


def test_a_huge_file_is_refused_unread(tmp_path):
    big = tmp_path / "big.png"
    with open(big, "wb") as f:
        f.truncate(400 << 20)  # sparse: 400 MiB of size, no disk
    script = f"""
import json, resource
from minivllm.multimodal.utils import fetch_image
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    fetch_image("file://{big}", "{tmp_path}")
    error = None
except ValueError as e:
    error = str(e)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"error": error, "grew_kib": after - before}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["error"] and f"has {400 << 20} bytes" in got["error"], got
    assert got["grew_kib"] < 100 << 10, got  # was about 400 MiB


@pytest.mark.parametrize("url, words", [
    ("file://{root}", "is a folder, not an image file"),
    ("file://{root}/sub", "is a folder, not an image file"),
    ("file://{root}/missing.png", "is no file, not an image file"),
    ("file://imgs/cat.png", "a file URL is file:///absolute/path; got host 'imgs'"),
])
def test_local_paths_that_are_no_image_file_say_why(tmp_path, url, words):
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match="image_url: .*" + words.replace("(", r"\(").replace(")", r"\)")):
        fetch_image(url.format(root=tmp_path), str(tmp_path))
