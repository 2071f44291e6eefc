"""Hand-made Criteo lines, and the records and dead letters an import must make of them."""

import json

import tensorflow as tf

import pipelines

INTS = [f"int_{i}" for i in range(1, 14)]
CATS = [f"cat_{i}" for i in range(1, 27)]


def criteo_line(label: str, ints: dict[int, str], cats: dict[int, str]) -> str:
    """A line: the label, int_i = ints.get(i, ""), cat_i = cats.get(i, "")."""
    fields = (
        [label] + [ints.get(i, "") for i in range(1, 14)] + [cats.get(i, "") for i in range(1, 27)]
    )
    return "\t".join(fields)


# (line, the Example's features as {key: [values]}, or the dead letter's reason)
CRITEO_LINES = [
    (
        criteo_line(
            "1", {i: str(i * 10) for i in range(1, 14)}, {i: f"{i:08x}" for i in range(1, 27)}
        ),
        {
            "label": [1],
            **{f"int_{i}": [i * 10] for i in range(1, 14)},
            **{f"cat_{i}": [f"{i:08x}".encode()] for i in range(1, 27)},
        },
    ),
    # Empty fields are absent; a negative count is an integer.
    (
        criteo_line("0", {1: "-1", 5: "7"}, {2: "68fd1e64", 26: "ABCDEF01"}),
        {
            "label": [0],
            "int_1": [-1],
            "int_5": [7],
            "cat_2": [b"68fd1e64"],
            "cat_26": [b"ABCDEF01"],
        },
    ),
    (criteo_line("1", {3: "x12"}, {}), "column 'int_3': 'x12' is not an integer"),
    (criteo_line("0", {}, {1: "05db9164"}) + "\textra", "41 columns, expected 40"),
    ("1\t2\t3", "3 columns, expected 40"),
    (criteo_line("", {1: "1"}, {}), "empty label column 'label'"),
    (criteo_line("0", {}, {4: "zz"}), "column 'cat_4': 'zz' is not hexadecimal"),
    (
        criteo_line("1", {13: "3"}, {1: "05db9164", 9: "a8cd5504"}),
        {"label": [1], "int_13": [3], "cat_1": [b"05db9164"], "cat_9": [b"a8cd5504"]},
    ),
    (criteo_line("0", {}, {}), {"label": [0]}),
    (criteo_line("0", {2: "1_000"}, {}), "column 'int_2': '1_000' is not an integer"),
]


def write_criteo(path: str) -> None:
    with open(path, "w") as file:
        file.write("".join(line + "\n" for line, _ in CRITEO_LINES))


def expected_records() -> list[dict]:
    return [want for _, want in CRITEO_LINES if isinstance(want, dict)]


def expected_dead_letters(path: str) -> list[dict]:
    return [
        {"file": path, "line": number, "reason": want}
        for number, (_, want) in enumerate(CRITEO_LINES, start=1)
        if isinstance(want, str)
    ]


def expected_distinct(records: list[dict]) -> dict[str, int]:
    keys = ["label", *INTS, *CATS]
    return {key: len({tuple(r[key]) for r in records if key in r}) for key in keys}


def as_dict(record: bytes) -> dict:
    """An Example as {key: [values]} (bytes, ints or floats by the feature's kind)."""
    example = tf.train.Example.FromString(record)
    features = {}
    for key, feature in example.features.feature.items():
        kind = feature.WhichOneof("kind")
        features[key] = list(getattr(feature, kind).value)
    return features


def read_back(files: list[str]) -> list[dict]:
    return [as_dict(record) for record in pipelines.read_records(files)]


def letters(path: str) -> list[dict]:
    with open(path) as file:
        return sorted((json.loads(line) for line in file), key=lambda d: (d["file"], d["line"]))
