import pytest

from kvserve.offload import TierOptions, parse_offload, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("0", 0),
        ("100B", 100),
        ("100KB", 100_000),
        ("512MiB", 512 * 1024**2),
        ("8GiB", 8 * 1024**3),
        ("8gib", 8 * 1024**3),
        ("1.5GB", 1_500_000_000),
        ("1.5 GiB", 3 * 1024**3 // 2),
        ("2TB", 2 * 1000**4),
        ("1TiB", 1024**4),
        ("3mb", 3_000_000),
        (" 7 KiB ", 7 * 1024),
        (".5KiB", 512),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "8XB", "-1GiB", "1e3", "8 G", "1,5GB", "0x10"])
def test_parse_size_names_the_bad_text(text):
    with pytest.raises(ValueError, match="invalid size") as info:
        parse_size(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cpu:1GiB", [TierOptions("cpu", 1024**3, None)]),
        ("disk:/tmp/kv:10GiB", [TierOptions("disk", 10 * 1024**3, "/tmp/kv")]),
        (
            "cpu:8GiB,disk:/path/to/dir:50GiB",
            [
                TierOptions("cpu", 8 * 1024**3, None),
                TierOptions("disk", 50 * 1024**3, "/path/to/dir"),
            ],
        ),
        (  # cpu first whatever the order written; spaces around parts; ':' inside the path
            "disk:/mnt/a:b:1GB , CPU:512MiB",
            [TierOptions("cpu", 512 * 1024**2, None), TierOptions("disk", 10**9, "/mnt/a:b")],
        ),
    ],
)
def test_parse_offload(text, expected):
    assert parse_offload(text) == expected


@pytest.mark.parametrize(
    ("text", "part", "reason"),
    [
        ("gpu:3GiB", "gpu:3GiB", "unknown tier 'gpu' (use cpu:<size> or disk:<dir>:<size>)"),
        ("cpu:1GiB,gpu:3GiB", "gpu:3GiB", "unknown tier 'gpu'"),
        ("cpu", "cpu", "missing size"),
        ("cpu:", "cpu:", "missing size"),
        ("disk:/tmp/kv", "disk:/tmp/kv", "missing size"),
        ("disk:/tmp/kv:", "disk:/tmp/kv:", "missing size"),
        ("disk:8GiB", "disk:8GiB", "missing directory"),
        ("disk::8GiB", "disk::8GiB", "empty directory"),
        ("cpu:8XB", "cpu:8XB", "bad size '8XB'"),
        ("disk:/tmp/kv:lots", "disk:/tmp/kv:lots", "bad size 'lots'"),
        ("cpu:0", "cpu:0", "capacity must be positive"),
        ("cpu:0.1B", "cpu:0.1B", "capacity must be positive"),
        ("cpu:1GiB,cpu:2GiB", "cpu:2GiB", "duplicate tier 'cpu'"),
        ("disk:/a:1GiB,disk:/b:1GiB", "disk:/b:1GiB", "duplicate tier 'disk'"),
        ("cpu:/tmp:1GiB", "cpu:/tmp:1GiB", "the cpu tier takes only a size"),
    ],
)
def test_parse_offload_errors_name_the_bad_part(text, part, reason):
    with pytest.raises(ValueError) as info:
        parse_offload(text)
    message = str(info.value)
    assert message.startswith(f"offload part {part!r}: ")
    assert reason in message


@pytest.mark.parametrize("text", ["", "  ", "cpu:1GiB,", ",disk:/x:1GiB", "cpu:1GiB,,disk:/x:1GiB"])
def test_parse_offload_empty_parts(text):
    with pytest.raises(ValueError, match="empty") as info:
        parse_offload(text)
    assert repr(text) in str(info.value)


def test_tier_options_are_checked():
    with pytest.raises(ValueError, match="needs a directory"):
        TierOptions("disk", 10, None)
    with pytest.raises(ValueError, match="takes no path"):
        TierOptions("cpu", 10, "/tmp")
    with pytest.raises(ValueError, match="positive"):
        TierOptions("cpu", 0, None)
    with pytest.raises(ValueError, match="unknown tier kind"):
        TierOptions("gpu", 10, None)
