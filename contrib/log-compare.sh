#!/bin/bash
# Usage: log-compare.sh MAILLOG_STOCK MAILLOG_PYQMGR
# Shows how the qmgr lines of two logs differ once ids, pids and times are removed.
norm() {
    grep ' postfix/qmgr\[' "$1" \
    | sed -E 's/^[A-Z][a-z]{2} [ 0-9]{2} [0-9:]{8} [^ ]+ //; s/\[[0-9]+\]//; s/\b[0-9A-F]{10,12}\b/QID/g' \
    | sort | uniq -c | sort -rn
}
diff <(norm "$1") <(norm "$2") && echo "no differences in qmgr lines"
