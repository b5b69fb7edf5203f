//! `compare --out DIR`: `report.html`, the report as one self-contained page
//! (inline CSS, the SVG plots inlined, no script, nothing fetched).
//!
//! It renders the subset of Markdown that `report.md` uses: `#` headings,
//! paragraphs, `- ` lists, pipe tables, fenced code blocks, `` `code` ``,
//! `**bold**` and `![alt](file.svg)` images, whose SVG is read from the
//! report's directory and inlined.

use std::fmt::Write as _;
use std::path::Path;

const STYLE: &str =
    "body{font-family:sans-serif;max-width:1300px;margin:2em auto;padding:0 1em;color:#222}\
table{border-collapse:collapse;margin:1em 0;font-size:13px}\
th,td{border:1px solid #bbb;padding:3px 7px}th{background:#eee}td.n{text-align:right}\
pre{background:#f6f6f6;padding:.6em;overflow-x:auto;font-size:12px}\
code{background:#f2f2f2;padding:0 2px}figure{margin:1em 0}svg{max-width:100%;height:auto}";

/// Escapes text for HTML.
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Inline Markdown: `code` and **bold**, escaped.
fn inline(s: &str) -> String {
    let mut out = String::new();
    for (i, part) in s.split('`').enumerate() {
        if i % 2 == 1 {
            let _ = write!(out, "<code>{}</code>", escape(part));
        } else {
            for (j, p) in part.split("**").enumerate() {
                if j % 2 == 1 {
                    let _ = write!(out, "<b>{}</b>", escape(p));
                } else {
                    out.push_str(&escape(p));
                }
            }
        }
    }
    out
}

/// An image line `![alt](file)`: the file's SVG inlined (its XML prolog
/// dropped), or a note where it cannot be read.
fn image(line: &str, dir: &Path) -> Option<String> {
    let rest = line.trim().strip_prefix("![")?;
    let (alt, rest) = rest.split_once("](")?;
    let file = rest.strip_suffix(')')?;
    let body = match std::fs::read_to_string(dir.join(file)) {
        Ok(svg) => {
            let start = svg.find("<svg").unwrap_or(0);
            svg[start..].to_string()
        }
        Err(e) => format!("<p>({}: {})</p>", escape(file), escape(&e.to_string())),
    };
    Some(format!(
        "<figure>{body}<figcaption>{}</figcaption></figure>\n",
        escape(alt)
    ))
}

fn cells(line: &str) -> Vec<&str> {
    let t = line.trim().trim_start_matches('|').trim_end_matches('|');
    t.split('|').map(str::trim).collect()
}

/// Renders `md` (as `report.md` writes it) as a complete HTML page; images
/// are read from `dir`.
pub fn render(title: &str, md: &str, dir: &Path) -> String {
    let mut out = format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title><style>{STYLE}</style></head><body>\n",
        escape(title)
    );
    let lines: Vec<&str> = md.lines().collect();
    let mut i = 0;
    let mut para: Vec<&str> = Vec::new();
    let flush = |para: &mut Vec<&str>, out: &mut String| {
        if !para.is_empty() {
            let _ = writeln!(out, "<p>{}</p>", inline(&para.join(" ")));
            para.clear();
        }
    };
    while i < lines.len() {
        let l = lines[i];
        let t = l.trim();
        if t.starts_with("```") {
            flush(&mut para, &mut out);
            out.push_str("<pre>");
            i += 1;
            while i < lines.len() && !lines[i].trim().starts_with("```") {
                out.push_str(&escape(lines[i]));
                out.push('\n');
                i += 1;
            }
            out.push_str("</pre>\n");
        } else if t.starts_with('#') {
            flush(&mut para, &mut out);
            let level = t.chars().take_while(|&c| c == '#').count().min(6);
            let _ = writeln!(out, "<h{level}>{}</h{level}>", inline(t[level..].trim()));
        } else if t.starts_with('|') {
            flush(&mut para, &mut out);
            out.push_str("<table>\n");
            let mut row = 0;
            while i < lines.len() && lines[i].trim().starts_with('|') {
                let c = cells(lines[i]);
                let sep = c
                    .iter()
                    .all(|x| !x.is_empty() && x.chars().all(|ch| matches!(ch, '-' | ':')));
                if !sep {
                    let tag = if row == 0 { "th" } else { "td" };
                    out.push_str("<tr>");
                    for x in c {
                        let num = tag == "td" && x.parse::<f64>().is_ok();
                        let class = if num { " class=\"n\"" } else { "" };
                        let _ = write!(out, "<{tag}{class}>{}</{tag}>", inline(x));
                    }
                    out.push_str("</tr>\n");
                    row += 1;
                }
                i += 1;
            }
            out.push_str("</table>\n");
            continue;
        } else if t.starts_with("- ") {
            flush(&mut para, &mut out);
            out.push_str("<ul>\n");
            while i < lines.len() && lines[i].trim().starts_with("- ") {
                let mut item = lines[i].trim()[2..].to_string();
                // Continuation lines of the item (indented, not a new item).
                while i + 1 < lines.len()
                    && lines[i + 1].starts_with("  ")
                    && !lines[i + 1].trim().starts_with("- ")
                    && !lines[i + 1].trim().is_empty()
                {
                    i += 1;
                    item.push(' ');
                    item.push_str(lines[i].trim());
                }
                let _ = writeln!(out, "<li>{}</li>", inline(&item));
                i += 1;
            }
            out.push_str("</ul>\n");
            continue;
        } else if let Some(fig) = image(t, dir) {
            flush(&mut para, &mut out);
            out.push_str(&fig);
        } else if t.is_empty() {
            flush(&mut para, &mut out);
        } else {
            para.push(t);
        }
        i += 1;
    }
    flush(&mut para, &mut out);
    out.push_str("</body></html>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_tables_code_lists_and_inlines_svg() {
        let dir = std::env::temp_dir().join(format!("vmmalloc-html-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("p.svg"),
            "<?xml version=\"1.0\"?>\n<svg width=\"1\"><text>x</text></svg>\n",
        )
        .unwrap();
        let md = "# Title <1>\n\nSome `a<b>` and **bold**\ntext.\n\n- one\n- two\n  more\n\n\
                  | a | b |\n|---|---:|\n| x | 1.5 |\n\n```\nraw <pre>\n```\n\n![plot](p.svg)\n\n![gone](missing.svg)\n";
        let html = render("t", md, &dir);
        assert!(html.starts_with("<!DOCTYPE html>"));
        assert!(html.contains("<h1>Title &lt;1&gt;</h1>"));
        assert!(html.contains("<p>Some <code>a&lt;b&gt;</code> and <b>bold</b> text.</p>"));
        assert!(html.contains("<li>one</li>\n<li>two more</li>"));
        assert!(html.contains("<tr><th>a</th><th>b</th></tr>"));
        assert!(html.contains("<td>x</td><td class=\"n\">1.5</td>"));
        assert!(!html.contains("---"));
        assert!(html.contains("<pre>raw &lt;pre&gt;\n</pre>"));
        assert!(html.contains("<figure><svg width=\"1\"><text>x</text></svg>"));
        assert!(!html.contains("<?xml"));
        assert!(html.contains("missing.svg: "));
        // Self-contained: nothing to fetch.
        assert!(!html.contains("http://") && !html.contains("https://") && !html.contains("src="));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
