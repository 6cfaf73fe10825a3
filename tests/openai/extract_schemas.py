#!/usr/bin/env python3
"""Writes openai-schemas.json: the OpenAI response schemas the server tests validate against.

Source: openai/openai-openapi (https://github.com/openai/openai-openapi), file `openapi.json`
at commit UPSTREAM_COMMIT below. Usage:

    git -C <clone of openai/openai-openapi> show UPSTREAM_COMMIT:openapi.json > /tmp/openapi.json
    python3 tests/openai/extract_schemas.py /tmp/openapi.json

What it keeps: the component schemas in ROOTS and every schema they reach through `$ref`,
under `$defs` (refs rewritten to `#/$defs/Name`), so that a JSON Schema 2020-12 validator can
check `{"$ref": "#/$defs/CreateChatCompletionResponse", "$defs": ...}`.

What it changes, and nothing else:
- OpenAPI 3.0's `nullable: true` (which the file still uses in places although it declares
  3.1, and which JSON Schema validators ignore) becomes `anyOf: [<the schema>, {"type": "null"}]`.
- Documentation-only keywords (`description`, `title`, `example(s)`, `x-*`) are dropped.

The schemas come from a repository under the MIT licence; its notice is kept in the output
(`license`) and here:

    The MIT License

    Copyright (c) OpenAI (https://openai.com)

    Permission is hereby granted, free of charge, to any person obtaining a copy
    of this software and associated documentation files (the "Software"), to deal
    in the Software without restriction, including without limitation the rights
    to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
    copies of the Software, and to permit persons to whom the Software is
    furnished to do so, subject to the following conditions:

    The above copyright notice and this permission notice shall be included in
    all copies or substantial portions of the Software.

    THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
    IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
    FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
    AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
    LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
    OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN
    THE SOFTWARE.
"""

import json
import sys
from pathlib import Path

UPSTREAM = "https://github.com/openai/openai-openapi"
UPSTREAM_COMMIT = "f85dbe223d40e1a31cba812ab2d755c7e98a92a3"
LICENSE = __doc__[__doc__.index("The MIT License") :].strip()
LICENSE = "\n".join(line.strip() for line in LICENSE.splitlines())

ROOTS = [
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "ListModelsResponse",
    "ErrorResponse",
]

DOC_KEYS = {"description", "title", "example", "examples"}
PREFIX = "#/components/schemas/"


def reachable(schemas: dict) -> list:
    """ROOTS and every schema they reach through `$ref`, sorted by name."""
    seen = set()

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "$ref" and isinstance(value, str):
                    if not value.startswith(PREFIX):
                        raise SystemExit(f"unexpected $ref {value}")
                    name = value[len(PREFIX) :]
                    if name not in seen:
                        seen.add(name)
                        walk(schemas[name])
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    for root in ROOTS:
        seen.add(root)
        walk(schemas[root])
    return sorted(seen)


def convert(node):
    """Refs to `#/$defs/`, `nullable` to `anyOf [.., null]`, documentation keys dropped."""
    if isinstance(node, list):
        return [convert(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in DOC_KEYS or key.startswith("x-") or key == "nullable":
            continue
        if key == "$ref":
            out[key] = "#/$defs/" + value[len(PREFIX) :]
        elif key in ("properties", "$defs", "patternProperties"):
            # property names are names, not keywords: keep them all
            out[key] = {name: convert(sub) for name, sub in value.items()}
        else:
            out[key] = convert(value)
    if node.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    spec = json.loads(Path(sys.argv[1]).read_text())
    schemas = spec["components"]["schemas"]
    names = reachable(schemas)
    doc = {
        "$comment": (
            "Extracted by tests/openai/extract_schemas.py from openapi.json of "
            f"{UPSTREAM} at commit {UPSTREAM_COMMIT} (OpenAPI {spec.get('openapi')}, API version "
            f"{spec.get('info', {}).get('version')}). Validate a document against "
            '{"$ref": "#/$defs/<Name>", "$defs": <$defs below>} with JSON Schema 2020-12.'
        ),
        "source": {"repository": UPSTREAM, "commit": UPSTREAM_COMMIT, "file": "openapi.json"},
        "license": LICENSE,
        "roots": ROOTS,
        "$defs": {name: convert(schemas[name]) for name in names},
    }
    out = Path(__file__).with_name("openai-schemas.json")
    out.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    print(f"wrote {out}: {len(names)} schemas")


if __name__ == "__main__":
    main()
