import sys

from draftsmith.pipelines.main import main

if __name__ == "__main__":
    sys.exit(main())
