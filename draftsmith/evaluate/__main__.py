import sys

from draftsmith.evaluate.main import main

if __name__ == "__main__":
    sys.exit(main())
