"""scan, map and associative_scan: operators over the leading dim of their ``xs``; map
is a scan without a carry, and associative_scan's derivatives are scans."""
