// Small text and SVG helpers shared by the sidebar and the status bar.

export function bytes(n: number | null | undefined): string {
  if (n === null || n === undefined) {
    return '–';
  }
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function seconds(s: number | null | undefined): string {
  if (s === null || s === undefined) {
    return '–';
  }
  if (s < 60) {
    return `${s.toFixed(0)} s`;
  }
  const m = Math.floor(s / 60);
  return m < 60 ? `${m} min ${Math.round(s % 60)} s` : `${Math.floor(m / 60)} h ${m % 60} min`;
}

export function el(
  tag: string,
  attrs: Record<string, string> = {},
  children: (Node | string)[] = []
): HTMLElement {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    node.setAttribute(k, v);
  }
  node.append(...children);
  return node;
}

/** A loss sparkline: an SVG polyline scaled to its own range. */
export function sparkline(points: [number, number][], width = 180, height = 32): SVGElement {
  const ns = 'http://www.w3.org/2000/svg';
  const svg = document.createElementNS(ns, 'svg');
  svg.setAttribute('width', String(width));
  svg.setAttribute('height', String(height));
  svg.setAttribute('class', 'axon-nb-spark');
  if (points.length < 2) {
    return svg;
  }
  const xs = points.map(p => p[0]);
  const ys = points.map(p => p[1]);
  const [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  const [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  const fx = (x: number) => (x1 > x0 ? ((x - x0) / (x1 - x0)) * (width - 2) + 1 : 1);
  const fy = (y: number) => (y1 > y0 ? height - 1 - ((y - y0) / (y1 - y0)) * (height - 2) : height / 2);
  const line = document.createElementNS(ns, 'polyline');
  line.setAttribute('points', points.map(([x, y]) => `${fx(x).toFixed(1)},${fy(y).toFixed(1)}`).join(' '));
  svg.append(line);
  return svg;
}
