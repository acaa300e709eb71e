import sys

from torchnitro.cli import main

sys.exit(main())
