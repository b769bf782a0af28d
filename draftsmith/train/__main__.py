import sys

from draftsmith.train.main import main

if __name__ == "__main__":
    sys.exit(main())
