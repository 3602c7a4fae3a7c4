import sys

from mlpfuse.cli import main

sys.exit(main())
