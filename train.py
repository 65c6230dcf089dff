"""Long-context fine-tuning with ds_seqpar: see `python train.py --help` and docs/train.md."""

from ds_seqpar.cli import main

if __name__ == "__main__":
    main()
