"""One host of a multi-host input pipeline, for test_multihost.py.

    python host_process.py '{"data": [...], "process_index": 0, "ports": [p0, p1],
                             "workers": 2, "deadline_s": 20, "out": "host0.json"}'

Reads its share of the dataset through Grain with minibatching agreed over
the hosts' all-reduce groups, and writes to `out` the number of minibatches
of each batch (as every local device saw it), the first dense value of each
batch (which names its first record) and the error that stopped it, if any.
The limits are tiny (4 ids per partition) so that crowded ids force
minibatching.
"""

import json
import sys

import pipeline_cases as cases

import pipelines
from parallel import allreduce

BATCH = 16
LIMIT = 4


def main(args: dict) -> None:
    rank = args["process_index"]
    agreement = allreduce.AllReduceConfig(
        rank=rank,
        peers=tuple(f"127.0.0.1:{port}" for port in args["ports"]),
        deadline_s=args["deadline_s"],
    )
    preprocess = cases.preprocess_config(
        BATCH,
        local_devices=1,
        global_devices=2,
        partitions=2,
        limit=LIMIT,
        enable_minibatching=True,
        agreement=agreement,
    )
    batching = pipelines.BatchingConfig(
        global_batch_size=BATCH, process_index=rank, process_count=2
    )
    result = {"num_minibatches": [], "first_dense": [], "error": None}
    options = pipelines.GrainOptions(worker_count=args["workers"])
    with pipelines.make_grain_iterator(
        args["data"], batching=batching, preprocess=preprocess, options=options
    ) as iterator:
        try:
            for batch in iterator:
                result["num_minibatches"].append(batch.preprocessed.num_minibatches.tolist())
                result["first_dense"].append(float(batch.dense[0, 0]))
        except pipelines.HostAgreementError as error:
            result["error"] = str(error)
    with open(args["out"], "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
