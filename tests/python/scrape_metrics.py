"""Scrapes a ringd's /metrics and parses it with Prometheus's own text parser (prometheus_client).

  /usr/bin/python3 scrape_metrics.py URL

Prints one JSON document: {"content_type": ..., "families": [{"name", "type", "help", "samples":
[{"name", "labels", "value"}]}]}. Exits 1 with the parser's error when the text does not parse.
The parser drops a counter's _total from the family name (its samples keep it).
"""
import json
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def main():
    with urllib.request.urlopen(sys.argv[1], timeout=10) as r:
        content_type = r.headers.get("Content-Type", "")
        text = r.read().decode("utf-8")
    try:
        families = [{"name": f.name, "type": f.type, "help": f.documentation,
                     "samples": [{"name": s.name, "labels": s.labels, "value": s.value} for s in f.samples]}
                    for f in text_string_to_metric_families(text)]
    except Exception as e:  # the parser raises ValueError and others on bad text
        sys.exit(f"scrape_metrics: the text does not parse: {e!r}\n{text[:2000]}")
    json.dump({"content_type": content_type, "families": families}, sys.stdout)


if __name__ == "__main__":
    main()
