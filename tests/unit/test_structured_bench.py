"""bench.structured's schemas: as many as asked, all distinct, each a grammar llguidance compiles."""

from __future__ import annotations

import json

from cascade_service.bench.structured import schemas
from cascade_service.core.grammar import ResponseFormat


def test_fifty_distinct_schemas_that_compile():
    made = schemas(50)
    assert len({json.dumps(s, sort_keys=True) for s in made}) == 50
    for schema in made:
        assert schema["type"] == "object" and schema["required"]
        assert ResponseFormat("json_schema", json.dumps(schema)).grammar()
