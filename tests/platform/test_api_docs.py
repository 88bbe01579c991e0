"""/api/docs/ renders Swagger UI from assets this server serves itself (no CDN is reachable offline)."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin, urlparse

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


class _AssetCollector(HTMLParser):
    """Every URL the page loads by itself: script src, link href (stylesheets, icons), img src."""

    def __init__(self):
        super().__init__()
        self.assets: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in ("script", "img", "iframe") and attrs.get("src"):
            self.assets.append(attrs["src"])
        elif tag == "link" and attrs.get("href"):
            self.assets.append(attrs["href"])


def _assets(html: str) -> list[str]:
    collector = _AssetCollector()
    collector.feed(html)
    return collector.assets


@pytest.mark.django_db(transaction=True)
def test_swagger_ui_loads_only_local_assets_and_they_are_served(asgi_server):
    base = f"http://{asgi_server}"
    page = httpx.get(f"{base}/api/docs/", timeout=30)
    assert page.status_code == 200
    assets = _assets(page.text)
    assert any(url.endswith("swagger-ui-bundle.js") for url in assets), assets
    assert any(url.endswith("swagger-ui.css") for url in assets), assets
    for url in assets:
        parsed = urlparse(urljoin(f"{base}/api/docs/", url))
        assert (parsed.scheme, parsed.netloc) == ("http", asgi_server), f"{url} is not served by this server"
        served = httpx.get(parsed.geturl(), timeout=30)
        assert served.status_code == 200 and len(served.content) > 100, url
    # The bundle is the real Swagger UI, not an empty placeholder.
    bundle = next(url for url in assets if url.endswith("swagger-ui-bundle.js"))
    assert b"SwaggerUIBundle" in httpx.get(urljoin(f"{base}/api/docs/", bundle), timeout=30).content
    # The schema the page renders is served too.
    schema = httpx.get(f"{base}/api/schema/", timeout=30)
    assert schema.status_code == 200 and b"openapi" in schema.content


EXTERNAL_ASSET = re.compile(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)\s*=\s*[\"']?(?:https?:)?//", re.I)


def test_no_template_loads_an_asset_from_another_host():
    templates = [p for p in ROOT.glob("**/templates/**/*.html") if ".venv" not in p.parts and "node_modules" not in p.parts]
    assert len(templates) > 5
    offenders = [str(p.relative_to(ROOT)) for p in templates if EXTERNAL_ASSET.search(p.read_text())]
    assert offenders == []
