import sys

from draftsmith.extract.main import main

if __name__ == "__main__":
    sys.exit(main())
