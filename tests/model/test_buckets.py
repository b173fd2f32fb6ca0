"""Shape buckets shared by the sampler and the driver's training batches."""

from jaxrlvr.model import buckets


def test_bucket():
    assert buckets.bucket(5, (4, 8, 16)) == 8
    assert buckets.bucket(8, (4, 8, 16)) == 8
    assert buckets.bucket(17, (4, 8, 16)) == 32  # past the largest: multiples of it
    assert buckets.bucket(3, (1, 2, 4), multiple_of=4) == 4
    assert buckets.bucket(6, (1, 2, 4), multiple_of=4) == 8


def test_length_bucket_is_a_power_of_two_multiple_capped_at_the_maximum():
    assert [buckets.length_bucket(n) for n in (1, 16, 17, 33, 100)] == [16, 16, 32, 64, 128]
    assert buckets.length_bucket(70, maximum=80) == 80  # 128, capped
    assert buckets.length_bucket(100, maximum=64) == 100  # never below the length
    assert buckets.length_bucket(5, minimum=4) == 8
